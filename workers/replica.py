"""Ray Serve deployment: one replica owns one in-process vLLM engine.

The ingress calls ``generate`` through ``handle.options(stream=True)``; each item is an
``engine.Delta``. A control loop runs at the control period: it reports each active request's
entropy profile (and, once a second, the replica's metric families) to the controller, and
publishes π(s) for the scheduler: the controller's answer when it comes within
``controller_timeout_s``, else π computed locally from the same profiles.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import asdict
from typing import Any, AsyncIterator

from ray import serve

from controller.laws.priority import priorities
from deployments.config import AppConfig
from workers.errors import InvalidRequest
from workers.tracking import GrantBoard, PriorityBoard, SequenceTrack

logger = logging.getLogger(__name__)

_METRICS_PERIOD_S = 1.0
_LEAVE_GRACE_S = 0.5


# Serve marks a replica unhealthy after three failed checks in a row: every 2 s keeps that under 10 s.
@serve.deployment(name="EntropicWorker", health_check_period_s=2, health_check_timeout_s=30)
class EntropicWorker:
    def __init__(self, config: dict[str, Any], controller: Any = None) -> None:
        self.config = AppConfig.model_validate(config)
        from workers.engine import configure_process_env

        configure_process_env(self.config.engine.cpu_threads, self.config.engine.kv_cache_space_gib)
        from workers.pruning_state import STATE

        STATE.dense_layers = self.config.pruning_dense_layers
        from workers.engine import EngineRunner
        from workers.metrics import ReplicaMetrics
        from workers.model_store import resolve_model

        model_path = str(resolve_model(self.config.model))
        self.metrics = ReplicaMetrics(self.config.model_name, self.config.engine.max_num_seqs)
        engine_kwargs = self.config.engine.engine_kwargs(model_path, self.config.model_name,
                                                         on_gpu=self.config.num_gpus_per_replica > 0,
                                                         pruning=self.config.pruning.enabled)
        self.scheduling = self.config.scheduling
        if self.scheduling.enabled:
            engine_kwargs.update(scheduler_cls="workers.scheduler.EntropicScheduler", scheduling_policy="priority")
        self._event_loop = asyncio.get_event_loop()
        self.runner = EngineRunner(engine_kwargs, on_step=self.metrics.observe_step, on_fatal=self._engine_failed)
        self.generation_defaults = self.runner.engine.model_config.get_diff_sampling_param()
        self.block_size = self.runner.engine.vllm_config.cache_config.block_size
        self.board = PriorityBoard()
        self.grants = GrantBoard(self.scheduling.grant_policy()) if self.scheduling.grant_slots else None
        if self.scheduling.enabled:
            self.runner.scheduler.board = self.board
            self.runner.scheduler.grants = self.grants
            self.runner.scheduler.preempt_margin = self.scheduling.preempt_margin
        self._weights = self.scheduling.weights()
        self._priorities: dict[str, tuple[float, str]] = {}
        self._preemptions_seen = 0
        self._routing_polls = 0
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # outside Serve (direct construction in a test)
            self.replica_id = uuid.uuid4().hex[:8]
        import ray

        self.node_id = ray.get_runtime_context().get_node_id()
        self._controller = controller
        self._active: dict[str, dict[str, Any]] = {}
        self._reported_active = False
        self._control = asyncio.get_event_loop().create_task(self._control_loop())

    async def generate(self, kind: str, request: Any, control_overrides: dict[str, Any] | None) -> AsyncIterator[Any]:
        from workers.prompts import prompt_token_ids, sampling_params

        overrides = dict(control_overrides or {})
        pruning_overrides = overrides.pop("pruning", None)
        try:
            control = self.config.sampling.merged(overrides)
            pruning = self.config.pruning.merged(pruning_overrides)
        except ValueError as exc:
            raise InvalidRequest(f"invalid entropic parameters: {exc}", "entropic") from None
        ids = prompt_token_ids(kind, request, self.runner.tokenizer)
        if not ids:
            raise InvalidRequest("the prompt is empty", "messages" if kind == "chat" else "prompt")
        key = f"{kind}-{uuid.uuid4().hex}"
        params = sampling_params(
            kind, request, len(ids), self.runner.max_model_len, self.generation_defaults, control, key, pruning
        )
        self.runner.validate(params)
        now = time.monotonic()
        track = self._active[key] = SequenceTrack(now, now, len(ids), self.scheduling.slo_s, params.max_tokens)
        try:
            async for delta in self.runner.generate(key, {"prompt_token_ids": ids}, params, len(ids)):
                track.observe(delta, time.monotonic(), self.scheduling.drop_ewma)
                yield delta
        finally:
            self._active.pop(key, None)

    def info(self) -> dict[str, Any]:
        leases = self.grants.leases() if self.grants is not None else {}
        return {"replica_id": self.replica_id, "max_model_len": self.runner.max_model_len, "steps": self.runner.steps,
                "priorities": {k: {"pi": pi, "source": src, "lease_steps": leases.get(k)}
                               for k, (pi, src) in self._priorities.items()}}

    def inject_engine_fault(self) -> str:
        """Stop this replica's engine loop from inside, as a crashing step would (``fault_injection``
        must be on): its streams fail, its health check fails, it leaves and Serve replaces it."""
        if not self.config.fault_injection:
            raise InvalidRequest("fault injection is off in this deployment", "fault_injection")
        self.runner.stop_with_error(RuntimeError("injected engine fault"))
        return self.replica_id

    async def record_routing_stats(self) -> dict[str, Any]:
        """Polled by Serve for deployments.routing.SoonestServedRouter."""
        running, waiting = self.runner.scheduler_counts()
        self._routing_polls += 1
        return {"at": time.time(), "running": running, "waiting": waiting,
                "max_num_seqs": self.config.engine.max_num_seqs, "step_s": self.metrics.recent_step_s,
                "unit_step_s": self.metrics.recent_unit_step_s}

    async def check_health(self) -> None:
        """Serve's health check: fails once the engine loop has stopped or one step has hung."""
        if not self.runner.alive:
            raise RuntimeError(f"engine loop stopped: {self.runner.fatal!r}")
        stalled = self.runner.stalled_for()
        if stalled > self.config.engine_stall_timeout_s:
            raise RuntimeError(f"engine loop has not gone round for {stalled:.0f} s")

    def _engine_failed(self, exc: BaseException) -> None:
        """Engine thread: the loop stopped. Its streams already have their error; leave the cluster.

        vLLM's own server exits when its engine dies (so an orchestrator restarts it); a replica
        does the same so Serve replaces it now, instead of after three failed health checks.
        """
        self._event_loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._leave(exc)))

    async def _leave(self, exc: BaseException) -> None:
        await asyncio.sleep(_LEAVE_GRACE_S)  # let the in-band errors reach the ingress first
        logger.error("engine failed (%r): replica %s exits so Serve replaces it", exc, self.replica_id)
        try:
            import ray

            ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
        except Exception:  # not a Ray actor (constructed directly): check_health still reports it
            logger.exception("could not exit the replica")

    async def _control_loop(self) -> None:
        """Each control period: report telemetry, take π from the controller or compute it locally."""
        period = self.config.telemetry_period_s
        next_metrics = 0.0
        while True:
            await asyncio.sleep(period)
            try:
                next_metrics = await self._control_step(next_metrics)
            except Exception:  # one bad period must not end telemetry and scheduling for good
                logger.exception("control step failed")

    async def _control_step(self, next_metrics: float) -> float:
        from workers.metrics import snapshot

        now = time.monotonic()
        active = dict(self._active)
        states = {k: t.state(now, self.scheduling.prior_drop, self.block_size) for k, t in active.items()}
        report: dict[str, Any] = {
            "sent_at": time.time(), "sequences": {k: asdict(s) for k, s in states.items()},
            "summaries": {k: t.summary(now) for k, t in active.items()}, "node_id": self.node_id,
            "routing_stats_polls": self._routing_polls,
            "leases": self.grants.leases() if self.grants is not None else None}
        report["running"], report["waiting"] = self.runner.scheduler_counts()
        # For routing (controller.laws.routing): how soon this replica's slots free up.
        cap = self.scheduling.remaining_cap_tokens
        report.update(max_num_seqs=self.config.engine.max_num_seqs, step_s=self.metrics.recent_step_s,
                      unit_step_s=self.metrics.recent_unit_step_s,
                      remaining=[min(s.remaining_tokens, cap) for k, s in states.items() if active[k].generated])
        if now >= next_metrics:
            report["metrics"] = snapshot()
            next_metrics = now + _METRICS_PERIOD_S
        elif not active and not self._reported_active:
            return next_metrics  # idle and already said so: the once-a-second metrics report keeps it live
        self._reported_active = bool(active)
        answer = None
        if self._controller is not None:
            try:  # the controller is advisory: a slow or missing one never stalls serving
                answer = await asyncio.wait_for(self._controller.report.remote(self.replica_id, report),
                                                timeout=self.scheduling.controller_timeout_s)
            except Exception as exc:
                logger.debug("telemetry report failed: %r", exc)
        if self.scheduling.enabled and states:
            local = priorities(states, self._weights)
            remote = answer.get("priorities", {}) if isinstance(answer, dict) else {}
            chosen = {k: (remote[k], "controller") if k in remote else (pi, "local") for k, pi in local.items()}
            self._priorities = chosen
            self.board.publish({k: pi for k, (pi, _) in chosen.items()})
            if self.grants is not None:  # the controller's grant decision when it answered, else the local one
                granted = answer.get("granted") if isinstance(answer, dict) else None
                self.grants.renew({k: pi for k, (pi, _) in chosen.items()}, granted)
            self.metrics.observe_priorities(chosen.values())
            self.metrics.observe_grants(self.grants.renewals if self.grants is not None else 0,
                                        self.runner.scheduler.withheld_steps)
            preemptions = self.runner.scheduler.priority_preemptions
            self.metrics.observe_preemptions(preemptions - self._preemptions_seen)
            self._preemptions_seen = preemptions
        return next_metrics

    def __del__(self) -> None:
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.shutdown()
