"""The central controller as a single-replica Serve deployment (the logic: ``controller.service``)."""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from controller.messages import Admission, ControllerAnswer, Grant, RoutingView, TelemetryReport
from controller.service import EntropyController
from deployments.config import AppConfig
from deployments.ray_metrics import mirror_periodically


# No access log: every replica reports 20 times a second, which would flood the console of `make serve`.
@serve.deployment(name="EntropyController", num_replicas=1, max_ongoing_requests=1000,
                  ray_actor_options={"num_cpus": 0}, logging_config={"enable_access_log": False})
class ControllerDeployment:
    def __init__(self, config: dict[str, Any]) -> None:
        app = AppConfig.model_validate(config)
        self._controller = EntropyController(app.scheduling, app.dispatch, app.migration)
        self._metrics_mirror = mirror_periodically(self._controller.own_metric_families, "controller")

    # Async, so they run on the replica's event loop (Serve runs plain methods in a thread pool): the
    # dispatch queue's futures belong to that loop.
    async def report(self, report: TelemetryReport) -> ControllerAnswer:
        return self._controller.report(report)

    async def admit(self, admission: Admission) -> AsyncIterator[Grant | None]:
        """Called with ``stream=True``: first ``None`` once the request is queued (the ingress bounds only
        this wait), then its ``Grant``. A caller that stops listening withdraws the request."""
        future = self._controller.enqueue(admission)
        try:
            yield None
            yield await future
        finally:
            self._controller.withdraw(admission.key, future)

    async def dispatch_view(self) -> dict[str, Any]:
        return self._controller.dispatch_view()

    def routing_view(self) -> RoutingView:
        return self._controller.routing_view()

    def metric_families(self) -> list:
        return self._controller.metric_families()

    def profiles(self) -> dict[str, Any]:
        return self._controller.profiles()
