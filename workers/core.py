"""One replica without Ray: its engine, its requests, and the control step around them.

``ReplicaCore`` is what serves: ``deployments.worker`` wraps it as a Serve deployment, and every
benchmark and the ablation harness drive it directly. It owns

* the engine (``workers.engine.EngineRunner``: one vLLM engine stepped by one thread);
* the request path: an OpenAI request (vLLM's protocol model) and its ``entropic`` overrides become
  prompt token ids and SamplingParams, checked against the model, then a stream of ``Delta``;
* the control step, every ``telemetry_period_s`` (skipped while the engine has not stepped since the
  last one): a ``TelemetryReport`` to the controller, π for the scheduler from its ``ControllerAnswer``
  (or, when it is late or absent, computed here from the same profiles by the same law), decode-step
  grants, and the replica's metrics.

The controller is reached through ``controller``: an async callable taking a report and returning
the answer (a Serve handle call in a deployment; ``controller.service.EntropyController`` in
process, or nothing, in a benchmark).
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from controller.laws.priority import priorities
from controller.laws.routing import ReplicaLoad
from controller.messages import ControllerAnswer, TelemetryReport
from workers.aio import wait_for
from workers.config import ReplicaConfig
from workers.control_params import EPIC_FIELDS
from workers.engine import Delta, EngineRunner, configure_process_env
from workers.epic import EpicDecoder
from workers.errors import InvalidRequest
from workers.metrics import ReplicaMetrics
from workers.step_threads import StepThreads
from workers.tracking import GrantBoard, PriorityBoard, SequenceTrack

logger = logging.getLogger(__name__)

ControllerLink = Callable[[TelemetryReport], Awaitable[ControllerAnswer | None]]

_METRICS_PERIOD_S = 1.0


class ReplicaCore:
    def __init__(self, config: ReplicaConfig, *, replica_id: str | None = None, node_id: str = "",
                 controller: ControllerLink | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None,
                 metrics_registry: Any = None, logits_processors: Sequence[type] = (),
                 step_threads: StepThreads | None = None) -> None:
        """``logits_processors``: more vLLM logits processors next to ours (benchmarks' instruments);
        ``metrics_registry``: a Prometheus registry of its own (several cores in one process);
        ``step_threads``: the cores a pinned engine process may borrow for a large step (workers/process.py)."""
        config = config.layers_on()
        self.config = config
        configure_process_env(step_threads.max_threads if step_threads is not None else config.engine.threads(),
                              config.engine.kv_cache_space_gib)
        import torch

        from workers.model_store import fitted_epic_alpha, resolve_model
        from workers.pruning_state import STATE
        from workers.scheduler import PrefillGate

        STATE.dense_layers = config.pruning_dense_layers
        STATE.decode_kernel = config.engine.decode_kernel
        self.replica_id = replica_id or uuid.uuid4().hex[:8]
        self.node_id = node_id
        self.scheduling = config.scheduling
        kwargs: dict[str, Any] = {} if metrics_registry is None else {"registry": metrics_registry}
        self.metrics = ReplicaMetrics(config.model_name, config.engine.max_num_seqs, **kwargs)
        engine_kwargs = config.engine.engine_kwargs(str(resolve_model(config.model)), config.model_name,
                                                    on_gpu=torch.cuda.is_available(), pruning=config.pruning.enabled)
        if self.scheduling.enabled:
            engine_kwargs.update(scheduler_cls="workers.scheduler.EntropicScheduler", scheduling_policy="priority")
        self.runner = EngineRunner(engine_kwargs, on_step=self.metrics.observe_step, on_fatal=on_fatal,
                                   logits_processors=logits_processors, telemetry=config.telemetry,
                                   on_abort=self.metrics.observe_ended_early, step_threads=step_threads,
                                   cpu_sampler=config.engine.cpu_sampler)
        self.generation_defaults = self.runner.engine.model_config.get_diff_sampling_param()
        self.epic = EpicDecoder(self.runner)
        self.epic_alpha = fitted_epic_alpha(resolve_model(config.model))
        self.block_size = self.runner.engine.vllm_config.cache_config.block_size
        self.board = PriorityBoard()
        self.grants = GrantBoard(self.scheduling.grant_policy()) if self.scheduling.grant_slots else None
        if self.scheduling.enabled:
            scheduler = self.runner.scheduler
            scheduler.board, scheduler.grants = self.board, self.grants
            scheduler.preempt_margin = self.scheduling.preempt_margin
            gate = self.scheduling.prefill_gate_policy()
            scheduler.prefill_gate = PrefillGate(gate) if gate is not None else None
        self._weights = self.scheduling.weights()
        self._controller = controller
        self._active: dict[str, SequenceTrack] = {}
        self._finished: dict[str, int] = {}  # key -> tokens generated, ended at EOS/stop/length since the last report
        self._priorities: dict[str, tuple[float, str]] = {}
        self._preemptions_seen = 0
        self._reported_active = False
        self._reported_step = -1
        self._reported_keys: frozenset[str] = frozenset()
        self._next_metrics = 0.0
        self.routing_polls = 0
        self._control: asyncio.Task | None = None

    # --- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the control loop on the running event loop."""
        self._control = asyncio.get_running_loop().create_task(self._control_loop())

    def shutdown(self) -> None:
        if self._control is not None:
            self._control.cancel()
        self.runner.shutdown()

    # --- requests ------------------------------------------------------------------------------
    async def generate(self, kind: str, request: Any, overrides: dict[str, Any] | None = None,
                       key: str | None = None) -> AsyncIterator[Delta]:
        """Serve one OpenAI request (``kind``: "chat" or "completion"; ``request``: vLLM's protocol model
        of it) with its ``entropic`` overrides. Client mistakes raise ``InvalidRequest`` before anything
        reaches the engine. ``key``: the request's key in telemetry (the one the controller dispatched it
        under, so it can tell where it landed); a fresh one when None or already taken here."""
        from workers.prompts import prompt_token_ids, sampling_params

        if overrides and not self.config.telemetry:
            raise InvalidRequest("this deployment runs without entropy telemetry (telemetry: false), so it takes no "
                                 "entropic parameters", "entropic")
        overrides = dict(overrides or {})
        pruning_overrides = overrides.pop("pruning", None)
        epic_overrides = {name: overrides.pop(name) for name in EPIC_FIELDS if name in overrides}
        try:
            control = self.config.sampling.merged(overrides)
            pruning = self.config.pruning.merged(pruning_overrides)
            epic = self.config.epic.merged(epic_overrides)
        except ValueError as exc:
            raise InvalidRequest(f"invalid entropic parameters: {exc}", "entropic") from None
        if epic.enabled:
            _check_epic(kind, request)
            control = control.model_copy(update={"enabled": False})  # the tilt is an EPIC request's control
        ids = prompt_token_ids(kind, request, self.runner.tokenizer, self.runner.max_model_len)
        if not ids:
            raise InvalidRequest("the prompt is empty", "messages" if kind == "chat" else "prompt")
        if key is None or key in self._active:
            key = f"{kind}-{uuid.uuid4().hex}"
        params = sampling_params(kind, request, len(ids), self.runner.max_model_len, self.generation_defaults,
                                 control, key, pruning)
        self.runner.validate(params)
        if epic.enabled and params.temperature < 1e-5:
            raise InvalidRequest("decoding epic samples: a temperature of 0 is greedy decoding", "temperature")
        now = time.monotonic()
        track = self._active[key] = SequenceTrack(now, now, len(ids), self.scheduling.slo_s, params.max_tokens)
        try:
            prompt: dict[str, Any] = {"prompt_token_ids": ids}
            if request.cache_salt:  # a prefix cache of its own for those who share the salt, as in vLLM
                prompt["cache_salt"] = request.cache_salt
            stream = (self.epic.generate(key, ids, params, epic, self.epic_alpha if epic.alpha is None else epic.alpha,
                                         request.cache_salt)
                      if epic.enabled else self.runner.generate(key, prompt, params, len(ids)))
            async for delta in stream:
                track.observe(delta, time.monotonic(), self.scheduling.drop_ewma)
                if delta.epic:
                    self.metrics.observe_epic(delta.epic)
                if delta.finish_reason in ("stop", "length"):  # how long it really was: the predictor's label
                    self._finished[key] = delta.completion_tokens
                yield delta
        finally:
            self._active.pop(key, None)

    # --- state read by the deployment ----------------------------------------------------------
    def info(self) -> dict[str, Any]:
        leases = self.grants.leases() if self.grants is not None else {}
        return {"replica_id": self.replica_id, "max_model_len": self.runner.max_model_len, "steps": self.runner.steps,
                "alive": self.runner.alive,
                "priorities": {k: {"pi": pi, "source": src, "lease_steps": leases.get(k)}
                               for k, (pi, src) in self._priorities.items()}}

    def load(self) -> ReplicaLoad:
        """What routing needs of this replica now."""
        running, waiting = self.runner.scheduler_counts()
        # A request accepted here reaches the engine's scheduler only at the engine thread's next step, and
        # the controller stops counting a grant as in flight once a report shows its key: counted as
        # waiting meanwhile, it takes a slot in every view from the moment it lands
        waiting = max(waiting, len(self._active) - running)
        cap = self.scheduling.remaining_cap_tokens
        return ReplicaLoad(running=running, waiting=waiting, max_num_seqs=self.config.engine.max_num_seqs,
                           step_s=self.metrics.recent_step_s, unit_step_s=self.metrics.recent_unit_step_s,
                           remaining=tuple(min(t.remaining_tokens(), cap) for t in list(self._active.values())
                                           if t.generated))

    def health_problem(self) -> str | None:
        """Why this replica cannot serve, or None: the engine loop stopped, or one step has hung."""
        if not self.runner.alive:
            return f"engine loop stopped: {self.runner.fatal!r}"
        stalled = self.runner.stalled_for()
        if stalled > self.config.engine_stall_timeout_s:
            return f"engine loop has not gone round for {stalled:.0f} s"
        return None

    # --- control step --------------------------------------------------------------------------
    async def _control_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.telemetry_period_s)
            try:
                await self.control_step()
            except Exception:  # one bad period must not end telemetry and scheduling for good
                logger.exception("control step failed")

    async def control_step(self) -> None:
        """One control period: report telemetry, take π (and grants) from the controller or compute them here."""
        if not self.runner.alive:
            return  # say nothing: the controller's view drops a replica it stops hearing from
        now = time.monotonic()
        active = dict(self._active)
        send_metrics = now >= self._next_metrics
        step = self.runner.steps
        if send_metrics:
            self._next_metrics = now + _METRICS_PERIOD_S
        elif not active and not self._reported_active:
            return  # idle and already said so: the once-a-second metrics report keeps it live
        elif step == self._reported_step and active.keys() == self._reported_keys:
            # The engine has not stepped since the last report, so no profile has moved: a second report
            # would only repeat it. Where a step outlasts the period (a CPU at full batch), each report
            # costs the engine thread its share of this process's GIL for nothing.
            return
        self._reported_active = bool(active)
        self._reported_step, self._reported_keys = step, frozenset(active)
        finished, self._finished = self._finished, {}
        if send_metrics and self.runner.step_threads is not None:
            self.metrics.observe_borrowed(self.runner.step_threads.steps_borrowed, self.runner.step_threads.steps_refused)
        states = {k: t.state(now, self.scheduling.prior_drop, self.block_size, self.scheduling.entropy_terms)
                  for k, t in active.items()}
        kv_free, kv_total = self.runner.kv_tokens()
        report = TelemetryReport(
            replica_id=self.replica_id, node_id=self.node_id, sent_at=time.time(), sequences=states,
            summaries={k: t.summary(now) for k, t in active.items()}, load=self.load(),
            routing_stats_polls=self.routing_polls, leases=self.grants.leases() if self.grants is not None else None,
            kv_free_tokens=kv_free, kv_total_tokens=kv_total, finished=finished,
            metrics=self.metrics.snapshot() if send_metrics else None,
            unstarted={k: now - active[k].arrival for k in self.runner.unstarted if k in active})
        answer = None
        if self._controller is not None:
            try:  # the controller is advisory: a slow or missing one never stalls serving
                answer = await wait_for(self._controller(report), timeout=self.scheduling.controller_timeout_s)
            except Exception as exc:
                logger.debug("telemetry report failed: %r", exc)
        if answer is not None and answer.moves:
            for key, replica_id in answer.moves.items():
                self.runner.move(key, replica_id)
        if self.scheduling.enabled and states:
            self._apply(states, answer)

    def _apply(self, states: dict, answer: ControllerAnswer | None) -> None:
        local = priorities(states, self._weights)
        remote = answer.priorities if answer is not None else {}
        chosen = {k: (remote[k], "controller") if k in remote else (pi, "local") for k, pi in local.items()}
        self._priorities = chosen
        published = {k: pi for k, (pi, _) in chosen.items()}
        for key, pi in list(published.items()):  # an EPIC request's engine requests run at its π
            published.update(dict.fromkeys(self.epic.engine_keys(key), pi))
        self.board.publish(published)
        if self.grants is not None:  # the controller's grant decision when it answered, else the local one
            self.grants.renew({k: pi for k, (pi, _) in chosen.items()},
                              list(answer.granted) if answer is not None and answer.granted is not None else None)
        self.metrics.observe_priorities(chosen.values())
        scheduler = self.runner.scheduler
        self.metrics.observe_grants(self.grants.renewals if self.grants is not None else 0, scheduler.withheld_steps)
        self.metrics.observe_preemptions(scheduler.priority_preemptions - self._preemptions_seen)
        if scheduler.prefill_gate is not None:
            self.metrics.observe_prefill_deferred(scheduler.prefill_gate.deferred_steps)
        self._preemptions_seen = scheduler.priority_preemptions


def _check_epic(kind: str, request: Any) -> None:
    """What an EPIC request cannot have: its tokens are chosen outside the engine's sampler, so the engine's
    logprobs and grammars do not describe them (400 naming the field rather than ignoring it)."""
    asked = {"logprobs": request.logprobs is not None if kind == "completion" else request.logprobs or request.top_logprobs,
             "prompt_logprobs": request.prompt_logprobs, "echo": getattr(request, "echo", False),
             "response_format": request.response_format, "structured_outputs": request.structured_outputs,
             "tools": getattr(request, "tools", None) if getattr(request, "tool_choice", None) not in (None, "none",
                                                                                                    "auto") else None,
             "min_tokens": request.min_tokens}
    for field, value in asked.items():
        if value:
            raise InvalidRequest(f"{field} is not available with decoding epic", field)
