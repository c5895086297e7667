"""Entropic Prometheus metrics of one replica, next to the ``vllm:*`` metrics vLLM records.

vLLM's own stat loggers record the request metrics (TTFT, inter-token latency, end-to-end
latency, prompt/generation tokens, running/waiting requests, KV-cache usage) into this
process's default registry; we add the ``entropic_*`` series there too. The replica ships
the whole registry to the controller, and the ingress serves the merged view at /metrics.
"""
from __future__ import annotations

import math
import statistics
from collections import deque

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

from controller.laws.priority import ewma
from controller.laws.routing import batch_factor

_ENTROPY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 11.0)
_TEMPERATURE_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.85, 1.0, 1.2, 1.5, 2.0, 3.0, 5.0)
_TAU_BUCKETS = (0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
_PRIORITY_BUCKETS = (1e-5, 1e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1, 3, 10, 100)
_RATIO_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.999, 1.0)
_CANDIDATE_BUCKETS = (0.5, 1, 2, 3, 4, 6, 8, 12, 16, 20)  # Ray's histograms take only bounds > 0
_LOOKAHEAD_BUCKETS = (0.5, 1, 2, 4, 6, 8, 12, 16, 24, 32, 48)
_SECONDS_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0)


class ReplicaMetrics:
    def __init__(self, model_name: str, max_num_seqs: int = 1, registry: CollectorRegistry = REGISTRY) -> None:
        """``registry``: the process's default one when serving (vLLM's own series are there too); a
        benchmark running several replica cores in one process gives each its own."""
        self.registry = registry
        self.max_num_seqs = max_num_seqs
        self._unit_steps: deque[float] = deque(maxlen=64)
        def histogram(name: str, documentation: str, buckets: tuple) -> Histogram:
            return Histogram(name, documentation, ["model_name"], buckets=buckets, registry=registry).labels(model_name)

        self._entropy = histogram("entropic_token_entropy_nats",
                                  "Entropy estimate H_t of each generated token's distribution", _ENTROPY_BUCKETS)
        self._temperature = histogram("entropic_token_temperature",
                                      "Sampling temperature T_t of each generated token (0: greedy)", _TEMPERATURE_BUCKETS)
        self._tau = histogram("entropic_request_entropic_time_nats",
                              "Entropic time tau (sum of positive entropy drops) per finished request", _TAU_BUCKETS)
        self._estimator = histogram("entropic_estimator_seconds",
                                    "Time spent estimating entropy in one engine step", _SECONDS_BUCKETS)
        self._step = histogram("entropic_engine_step_seconds", "Wall time of one engine step", _SECONDS_BUCKETS)
        self._tokens = Counter("entropic_tokens", "Generated tokens that carried entropy telemetry",
                               ["model_name"], registry=registry).labels(model_name)
        self._priority = Histogram("entropic_priority", "π(s) published to the scheduler, per sequence and control period",
                                   ["model_name", "source"], buckets=_PRIORITY_BUCKETS, registry=registry)
        self._priority_sources = {src: self._priority.labels(model_name, src) for src in ("controller", "local")}
        self._kept_ratio = histogram("entropic_kv_blocks_kept_ratio",
                                     "KV blocks attended / blocks held, per decode step of a pruning-enabled request",
                                     _RATIO_BUCKETS)
        self._flops_saved = Counter("entropic_attention_flops_saved", "Attention FLOPs not computed thanks to KV pruning",
                                    ["model_name"], registry=registry).labels(model_name)
        self._bytes_saved = Counter("entropic_kv_bytes_saved", "KV-cache bytes not read thanks to KV pruning",
                                    ["model_name"], registry=registry).labels(model_name)
        self._selection = Counter("entropic_pruning_selection_seconds", "Time spent choosing KV blocks (all layers)",
                                  ["model_name"], registry=registry).labels(model_name)
        self._decode_kernel = Counter("entropic_decode_kernel_layers", "Layer attention calls of pure-decode steps "
                                      "our CPU decode kernel answered instead of vLLM's (engine.decode_kernel)",
                                      ["model_name"], registry=registry).labels(model_name)
        self._pruning_seen = (0.0, 0.0, 0.0, 0)
        self._grants = Counter("entropic_grants_renewed", "Decode-step leases renewed (sequences moved into the "
                               "granted set) by the control loop", ["model_name"], registry=registry).labels(model_name)
        self._withheld = Counter("entropic_grant_withheld_steps", "Running sequences left out of an engine step "
                                 "for lack of a decode-step grant", ["model_name"], registry=registry).labels(model_name)
        self._grants_seen = (0, 0)
        self._prefill_deferred = Counter("entropic_prefill_deferred_steps", "Engine steps the prefill gate ran without "
                                         "prefill chunks while requests decoded (scheduling.tpot_target_*)",
                                         ["model_name"], registry=registry).labels(model_name)
        self._prefill_deferred_seen = 0
        self._ended_early = Counter("entropic_requests_ended_early", "Requests that ended before they finished, by why: "
                                    "client_gone (the client disconnected), invalid (refused by the engine), failed, "
                                    "engine_stopped, moved (handed back, unstarted, for another replica: migration)",
                                    ["model_name", "reason"], registry=registry)
        self._ended_early_by = {r: self._ended_early.labels(model_name, r)
                                for r in ("client_gone", "invalid", "failed", "engine_stopped", "moved")}
        self._epic_tokens = Counter("entropic_epic_tokens", "Tokens drawn by entropy-aligned decoding (EPIC), by "
                                    "whether the draw was exact (false: the request's rollout budget cut it short)",
                                    ["model_name", "exact"], registry=registry)
        self._epic_exact = {e: self._epic_tokens.labels(model_name, e) for e in ("true", "false")}
        self._epic_rollout = Counter("entropic_epic_rollout_tokens", "Tokens generated by EPIC's lookahead rollouts",
                                     ["model_name"], registry=registry).labels(model_name)
        self._epic_candidates = histogram("entropic_epic_candidates_evaluated",
                                          "Candidates whose lookahead entropy was estimated, per EPIC token",
                                          _CANDIDATE_BUCKETS)
        self._epic_lookahead = histogram("entropic_epic_lookahead_entropy_nats",
                                         "Estimated lookahead entropy of the token EPIC chose, where it was estimated",
                                         _LOOKAHEAD_BUCKETS)
        self._preemptions = Counter("entropic_priority_preemptions", "Running requests preempted for a higher-π waiting one",
                                    ["model_name"], registry=registry).labels(model_name)
        borrowed = Counter("entropic_borrowed_core_steps", "Engine steps large enough to borrow the serving path's "
                           "cores (CPU, pinned engines), by outcome: borrowed, or refused (lent to another engine)",
                           ["model_name", "outcome"], registry=registry)
        self._borrowed = {o: borrowed.labels(model_name, o) for o in ("borrowed", "refused")}
        self._borrowed_seen = (0, 0)

    def observe_priorities(self, published) -> None:
        for pi, source in published:
            self._priority_sources[source].observe(pi)

    def observe_grants(self, renewals: int, withheld_steps: int) -> None:
        if renewals > self._grants_seen[0]:
            self._grants.inc(renewals - self._grants_seen[0])
        if withheld_steps > self._grants_seen[1]:
            self._withheld.inc(withheld_steps - self._grants_seen[1])
        self._grants_seen = (renewals, withheld_steps)

    def observe_prefill_deferred(self, deferred_steps: int) -> None:
        if deferred_steps > self._prefill_deferred_seen:
            self._prefill_deferred.inc(deferred_steps - self._prefill_deferred_seen)
            self._prefill_deferred_seen = deferred_steps

    def observe_ended_early(self, reason: str) -> None:
        self._ended_early_by[reason].inc()

    def observe_epic(self, steps: list) -> None:
        """``workers.engine.EpicStep`` of each EPIC token delivered."""
        for step in steps:
            self._epic_exact["true" if step.exact else "false"].inc()
            self._epic_rollout.inc(step.rollout_tokens)
            self._epic_candidates.observe(step.candidates_evaluated)
            if step.lookahead_entropy is not None:
                self._epic_lookahead.observe(step.lookahead_entropy)

    def observe_borrowed(self, borrowed: int, refused: int) -> None:
        """The engine's cumulative counts (workers.step_threads.StepThreads)."""
        for counter, new, old in zip(self._borrowed.values(), (borrowed, refused), self._borrowed_seen):
            if new > old:
                counter.inc(new - old)
        self._borrowed_seen = (borrowed, refused)

    def observe_preemptions(self, count: int) -> None:
        if count > 0:
            self._preemptions.inc(count)

    recent_step_s = 0.0  # EWMA of engine step time, for routing

    @property
    def recent_unit_step_s(self) -> float:
        """Decode step time normalized to an empty batch (controller.laws.routing.batch_factor), median of
        the last decode-only steps. Steps that prefilled are left out: their time follows the prompts'
        lengths, not the replica's speed, and an idle replica would keep the slow look of its last prefill
        (the router then sent every new request elsewhere)."""
        return statistics.median(self._unit_steps) if self._unit_steps else 0.0

    def observe_step(self, step_seconds: float, estimator_seconds: float, deltas: list, decode_only: bool) -> None:
        self.recent_step_s = ewma(self.recent_step_s or None, step_seconds, 0.1)
        if decode_only:
            self._unit_steps.append(step_seconds / batch_factor(len(deltas), self.max_num_seqs))
        self._step.observe(step_seconds)
        self._estimator.observe(estimator_seconds)
        for delta in deltas:
            for h, t in zip(delta.entropy, delta.temperature):
                if not math.isnan(h):
                    self._entropy.observe(h)
                    self._temperature.observe(t)
                    self._tokens.inc()
            for kept, total in delta.kv_blocks:
                self._kept_ratio.observe(kept / total)
            if delta.finished:
                self._tau.observe(delta.entropic_time)
        self._observe_pruning()

    def _observe_pruning(self) -> None:
        from workers.pruning_state import STATE

        now = (STATE.stats.attention_flops_saved, STATE.stats.kv_bytes_saved, STATE.stats.selection_seconds,
               STATE.stats.decode_kernel_layers)
        counters = (self._flops_saved, self._bytes_saved, self._selection, self._decode_kernel)
        for counter, new, old in zip(counters, now, self._pruning_seen, strict=True):
            if new > old:
                counter.inc(new - old)
        self._pruning_seen = now


    def snapshot(self) -> list:
        """Every metric family of this replica's registry, picklable, for shipping to the controller."""
        return list(self.registry.collect())
