"""Ray Serve deployment: one replica owns one in-process vLLM engine.

The ingress calls ``generate`` through ``handle.options(stream=True)``; each item is an
``engine.Delta``. A background task reports to the controller at the control period:
per-request entropy summaries every period, the replica's metric families every second.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, AsyncIterator

from ray import serve

from deployments.config import AppConfig
from workers.errors import InvalidRequest

logger = logging.getLogger(__name__)

_METRICS_PERIOD_S = 1.0


@serve.deployment(name="EntropicWorker", health_check_period_s=10, health_check_timeout_s=30)
class EntropicWorker:
    def __init__(self, config: dict[str, Any], controller: Any = None) -> None:
        self.config = AppConfig.model_validate(config)
        from workers.engine import configure_process_env

        configure_process_env(self.config.engine.cpu_threads, self.config.engine.kv_cache_space_gib)
        from workers.engine import EngineRunner
        from workers.metrics import ReplicaMetrics
        from workers.model_store import resolve_model

        model_path = str(resolve_model(self.config.model))
        self.metrics = ReplicaMetrics(self.config.model_name)
        self.runner = EngineRunner(
            self.config.engine.engine_kwargs(model_path, self.config.model_name,
                                             on_gpu=self.config.num_gpus_per_replica > 0),
            on_step=self.metrics.observe_step,
        )
        self.generation_defaults = self.runner.engine.model_config.get_diff_sampling_param()
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # outside Serve (direct construction in a test)
            self.replica_id = uuid.uuid4().hex[:8]
        self._controller = controller
        self._active: dict[str, dict[str, Any]] = {}
        self._reporter = asyncio.get_event_loop().create_task(self._report_loop()) if controller is not None else None

    async def generate(self, kind: str, request: Any, control_overrides: dict[str, Any] | None) -> AsyncIterator[Any]:
        from workers.prompts import prompt_token_ids, sampling_params

        try:
            control = self.config.sampling.merged(control_overrides)
        except ValueError as exc:
            raise InvalidRequest(f"invalid entropic parameters: {exc}", "entropic") from None
        ids = prompt_token_ids(kind, request, self.runner.tokenizer)
        if not ids:
            raise InvalidRequest("the prompt is empty", "messages" if kind == "chat" else "prompt")
        key = f"{kind}-{uuid.uuid4().hex}"
        params = sampling_params(
            kind, request, len(ids), self.runner.max_model_len, self.generation_defaults, control, key
        )
        from workers.engine import EngineRequestError

        summary = self._active[key] = {"arrival": time.time(), "prompt_tokens": len(ids), "tokens": 0}
        try:
            async for delta in self.runner.generate(key, {"prompt_token_ids": ids}, params, len(ids)):
                summary.update(
                    tokens=delta.completion_tokens, tau=delta.entropic_time, mean_entropy=delta.mean_entropy,
                    last_entropy=delta.entropy[-1] if delta.entropy else summary.get("last_entropy"),
                    temperature=delta.temperature[-1] if delta.temperature else summary.get("temperature"),
                )
                yield delta
        except EngineRequestError as exc:
            raise InvalidRequest(str(exc)) from None
        finally:
            self._active.pop(key, None)

    def info(self) -> dict[str, Any]:
        return {"replica_id": self.replica_id, "max_model_len": self.runner.max_model_len, "steps": self.runner.steps}

    async def check_health(self) -> None:
        if not self.runner.alive:
            raise RuntimeError(f"engine loop stopped: {self.runner.fatal!r}")

    async def _report_loop(self) -> None:
        from workers.metrics import snapshot

        period = self.config.telemetry_period_s
        next_metrics = 0.0
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            report: dict[str, Any] = {"sent_at": time.time(), "requests": dict(self._active)}
            report["running"], report["waiting"] = self.runner.scheduler_counts()
            if now >= next_metrics:
                report["metrics"] = snapshot()
                next_metrics = now + _METRICS_PERIOD_S
            elif not self._active:
                continue
            try:  # the controller is advisory: a slow or missing one never stalls serving
                await asyncio.wait_for(self._controller.report.remote(self.replica_id, report), timeout=5.0)
            except Exception as exc:
                logger.debug("telemetry report failed: %r", exc)

    def __del__(self) -> None:
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.shutdown()
