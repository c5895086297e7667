"""The central controller as a single-replica Serve deployment (the logic: ``controller.service``)."""
from __future__ import annotations

from typing import Any

from ray import serve

from controller.messages import ControllerAnswer, RoutingView, TelemetryReport
from controller.service import EntropyController
from deployments.config import AppConfig


# No access log: every replica reports 20 times a second, which would flood the console of `make serve`.
@serve.deployment(name="EntropyController", num_replicas=1, max_ongoing_requests=1000,
                  ray_actor_options={"num_cpus": 0}, logging_config={"enable_access_log": False})
class ControllerDeployment:
    def __init__(self, config: dict[str, Any]) -> None:
        self._controller = EntropyController(AppConfig.model_validate(config).scheduling)

    def report(self, report: TelemetryReport) -> ControllerAnswer:
        return self._controller.report(report)

    def routing_view(self) -> RoutingView:
        return self._controller.routing_view()

    def metric_families(self) -> list:
        return self._controller.metric_families()

    def profiles(self) -> dict[str, Any]:
        return self._controller.profiles()
