"""Ray Serve deployment around one ``workers.core.ReplicaCore``, which runs in a child process of the
replica (``workers.process.CoreProcess``: the engine does not share its GIL with Ray and Serve).

The ingress calls ``generate`` through ``handle.options(stream=True)``; each item is a
``workers.engine.Delta``, or, after the first, the rest come over the ingress's token channel
(``deployments.token_channel``) where the call brings a ticket for it. Serve calls ``check_health`` and
``record_routing_stats``; the core's control loop reports to the controller deployment through this
replica, which holds the handle.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve

from controller.messages import ControllerAnswer, Grant, TelemetryReport
from deployments.config import AppConfig
from deployments.token_channel import END, ON_CHANNEL, Ticket, TokenLink
from workers.engine import Delta
from workers.errors import InvalidRequest, ReplicaUnavailable, RequestError, RequestFailed, RequestMoved
from workers.process import CoreProcess

logger = logging.getLogger(__name__)

_LEAVE_GRACE_S = 0.5
_UNAVAILABLE_QUEUE = 1_000_000


def _import_protocol() -> None:
    """Requests arrive as deployments.protocol's vLLM models. Serve ships the worker class by value, so
    nothing imported them here yet: unpickling the first request would, seconds of CPU under the first load.
    Imported while the engine process starts, not before: that one runs on the engine's own cores."""
    import deployments.protocol  # noqa: F401


# Serve marks a replica unhealthy after three failed checks in a row: every 2 s keeps that under 10 s.
@serve.deployment(name="EntropicWorker", health_check_period_s=2, health_check_timeout_s=30)
class EntropicWorker:
    def __init__(self, config: dict[str, Any], controller: Any = None) -> None:
        self.config = AppConfig.model_validate(config)
        self._event_loop = asyncio.get_running_loop()
        self._tokens = TokenLink()
        replica_id = serve.get_replica_context().replica_id.unique_id
        # Imported here: Serve ships this class by value (see _import_protocol).
        from deployments.ray_metrics import RayMirror

        mirror = RayMirror(replica_id)

        async def report(message: TelemetryReport) -> ControllerAnswer:
            if message.metrics is not None:  # the child's registry, about once a second
                try:
                    mirror.update(message.metrics)
                except Exception:  # metrics must never stop a replica's reports
                    logger.exception("mirroring metrics to Ray failed")
            return await controller.report.remote(message)

        self.core = CoreProcess(self.config.replica(), replica_id=replica_id,
                                node_id=ray.get_runtime_context().get_node_id(),
                                controller=report if controller is not None else None, on_fatal=self._engine_failed,
                                preload=("deployments.protocol",), while_starting=_import_protocol)

    async def generate(self, kind: str, request: Any, overrides: dict[str, Any] | None,
                       grant: Grant | None = None, ticket: Ticket | None = None
                       ) -> AsyncIterator[Delta | RequestError | str]:
        """The request's deltas; an expected failure (the client's mistake, an engine that stopped, one
        request failing inside the engine, the controller moving it elsewhere before it started) is the last
        item, not raised: Serve logs every exception a replica raises with its traceback at ERROR, which a
        client's 400 is not. ``grant``: the controller's dispatch or move of it (deployments.routing sends it
        to the granted replica; its key names the request in this replica's telemetry). ``ticket``: the
        ingress's token channel; after the first delta, this yields ``ON_CHANNEL`` and sends the rest and the
        stream's end there, unless the ingress cannot be reached."""
        channel, first, stream_id = None, True, -1
        try:
            async for delta in self.core.generate(kind, request, overrides, grant.key if grant else None):
                if channel is not None:
                    channel.send(stream_id, delta)  # raises once the ingress has gone: aborts the request
                    continue
                yield delta
                if first and ticket is not None and not delta.finished:
                    channel, stream_id = await self._tokens.connect(ticket), ticket.stream_id
                    if channel is not None:
                        yield ON_CHANNEL
                first = False
            if channel is not None:
                channel.send(stream_id, END)
        except (InvalidRequest, ReplicaUnavailable, RequestFailed, RequestMoved) as exc:
            if channel is None:
                yield exc
                return
            try:
                channel.send(stream_id, exc)
            except ConnectionError:
                logger.info("token channel closed; request ended")
        except ConnectionError:  # the ingress closed the channel: its streams on it have failed there already
            logger.info("token channel closed; request ended")

    async def info(self) -> dict[str, Any]:
        return await self.core.info()

    async def record_routing_stats(self) -> dict[str, Any]:
        """Polled by Serve for deployments.routing.SoonestServedRouter (a dict: Serve's format)."""
        load, problem = await self.core.routing_stats()
        # A replica whose engine has stopped must not look idle: it ranks last until Serve replaces it.
        waiting = load.waiting if problem is None else _UNAVAILABLE_QUEUE
        return {"at": time.time(), "running": load.running, "waiting": waiting,
                "max_num_seqs": load.max_num_seqs, "step_s": load.step_s, "unit_step_s": load.unit_step_s}

    async def check_health(self) -> None:
        """Serve's health check: fails once the engine loop has stopped or one step has hung."""
        problem = await self.core.health_problem()
        if problem is not None:
            raise RuntimeError(problem)

    async def inject_engine_fault(self) -> str:
        """Stop this replica's engine loop from inside, as a crashing step would (``fault_injection``
        must be on): its streams fail, its health check fails, it leaves and Serve replaces it."""
        if not self.config.fault_injection:
            raise InvalidRequest("fault injection is off in this deployment", "fault_injection")
        await self.core.inject_fault()
        return self.core.replica_id

    def _engine_failed(self, exc: BaseException) -> None:
        """The engine loop (or its process) stopped. Its streams already have their error; leave the cluster.

        vLLM's own server exits when its engine dies (so an orchestrator restarts it); a replica
        does the same so Serve replaces it now, instead of after three failed health checks.
        """
        self._event_loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._leave(exc)))

    async def _leave(self, exc: BaseException) -> None:
        await asyncio.sleep(_LEAVE_GRACE_S)  # let the in-band errors reach the ingress first
        logger.error("engine failed (%r): replica %s exits so Serve replaces it", exc, self.core.replica_id)
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    def __del__(self) -> None:
        core = getattr(self, "core", None)
        if core is not None:
            core.shutdown()
