"""Serve application builder: ``import_path: deployments.app:build_app`` with ``args`` = AppConfig."""
from __future__ import annotations

from typing import Any

from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from deployments.config import AppConfig
from deployments.controller import ControllerDeployment
from deployments.openai_api import OpenAIIngress
from deployments.worker import EntropicWorker
from workers.engine import engine_process_env


def worker_runtime_env(config: AppConfig) -> dict[str, Any]:
    # Read by vLLM at import inside the replica process, before any engine code runs.
    return {"env_vars": engine_process_env(config.engine.threads(), config.engine.kv_cache_space_gib)}


def request_router_class(config: AppConfig) -> str | None:
    """The worker deployment's request router; None: Serve's default. With dispatch or migration on, one that
    sends a request to the replica the controller granted or moved it to."""
    if config.request_router == "soonest_served":
        return "deployments.routing.SoonestServedRouter"
    granted = config.dispatch.enabled or config.migration.enabled
    return "deployments.routing.GrantedPowerOfTwoRouter" if granted else None


def build_app(args: dict[str, Any] | AppConfig | None = None) -> Application:
    config = (args if isinstance(args, AppConfig) else AppConfig.model_validate(args or {})).resolved()
    as_dict = config.model_dump()
    # Serve's decorator turns each class into a Deployment (bind/options); mypy sees only the class.
    controller = ControllerDeployment.bind(as_dict)  # type: ignore[attr-defined]
    scaling: dict[str, Any] = (
        {"autoscaling_config": config.autoscaling.model_dump()} if config.autoscaling
        else {"num_replicas": config.num_replicas})
    worker = EntropicWorker.options(  # type: ignore[attr-defined]
        **scaling,
        max_ongoing_requests=config.ongoing_bound(),
        max_queued_requests=config.queue_bound(),
        request_router_config=RequestRouterConfig(
            **({"request_router_class": router} if (router := request_router_class(config)) else {}),
            request_routing_stats_period_s=0.5, request_routing_stats_timeout_s=2.0),
        ray_actor_options={
            "num_cpus": config.num_cpus_per_replica,
            "num_gpus": config.num_gpus_per_replica,
            "runtime_env": worker_runtime_env(config),
        },
    ).bind(as_dict, controller)
    return OpenAIIngress.bind(worker, controller, as_dict)  # type: ignore[attr-defined]
