"""Start the application on a local Ray cluster: ``python -m deployments.server [--model PATH]``.

For a Serve YAML config (``serve run config.yaml``) use ``import_path: deployments.app:build_app``
with ``args`` shaped like ``deployments.config.AppConfig``; this command is the shortcut.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import yaml
from pydantic import ValidationError

from deployments import serve_env
from deployments.config import AppConfig
from deployments.cpu_plan import NodeResources
from workers.cpu_cores import available_cpus


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, AppConfig]:
    parser = argparse.ArgumentParser(description="OpenAI-compatible entropic-time LLM server on Ray Serve")
    parser.add_argument("--model", help='"default" (SmolLM2-135M-Instruct) or a local Hugging Face model directory')
    parser.add_argument("--config", help="YAML/JSON file with AppConfig fields (or a Serve config's application args)")
    parser.add_argument("--num-replicas", type=int)
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--num-cpus", type=int, default=available_cpus(),
                        help="CPUs Ray may use (default: those this process may run on)")
    args = parser.parse_args(argv)
    raw: dict = {}
    if args.config:
        with open(args.config) as f:
            raw = yaml.safe_load(f) or {}
        if "applications" in raw:  # a Serve config file: take the first application's args
            raw = raw["applications"][0].get("args", {})
    if args.model:
        raw["model"] = args.model
    if args.num_replicas:
        raw["num_replicas"] = args.num_replicas
    if args.max_model_len:
        raw.setdefault("engine", {})["max_model_len"] = args.max_model_len
    try:
        return args, AppConfig.model_validate(raw)
    except ValidationError as exc:
        parser.error(f"invalid configuration:\n{exc}")  # exits


def main(argv: list[str] | None = None) -> int:
    args, config = parse_args(argv)
    serve_env.apply()  # before Ray starts (its processes inherit it) and before this process imports ray.serve
    import ray
    from ray import serve

    from workers.model_store import ModelPreparationError, resolve_model

    # The application's modules import vLLM's protocol models: seconds of CPU, spent on a thread of their own
    # while Ray and Serve start, after this thread's own imports (two threads importing one module at once
    # can fail, as Ray's did). Started before this thread narrows its cores, it keeps all of them.
    loader = ThreadPoolExecutor(1, thread_name_prefix="import-app")
    app_module = loader.submit(importlib.import_module, "deployments.app")
    loader.shutdown(wait=False)

    try:
        resolve_model(config.model)  # fail fast (and convert once) before any replica starts
    except ModelPreparationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if config.num_gpus_per_replica == 0:  # GPUs are counted once Ray has started (build_app resolves them)
        config = config.resolved([NodeResources(float(args.num_cpus))])
    keep_frontend_off_engine_cores(config)
    ray.init(num_cpus=args.num_cpus, include_dashboard=False)
    config = config.resolved()  # what is still "auto" (GPU counts), now that Ray has counted them

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    # As Ctrl-C, and in place of the handler ray.init installed, which tears the local cluster down at once.
    signal.signal(signal.SIGTERM, stop)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(app_module.result().build_app(config), name="entropic", route_prefix="/")
        base = f"http://{args.host}:{args.port}"
        print(json.dumps({"ready": base, "openai_base_url": f"{base}/v1", "metrics": f"{base}/metrics",
                          "model": config.model_name, "replicas": config.max_replicas(),
                          "engine_threads": config.engine.cpu_threads}), flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        drain(config.drain_timeout_s)
        serve.shutdown()
    return 0


def keep_frontend_off_engine_cores(config: AppConfig) -> None:
    """On CPU with ``engine.pin_cores``, run Ray (and so Serve's proxy, the ingress, the controller and the
    worker replicas, which inherit it) on the cores the engines leave free: each engine process pins
    itself to cores of its own from the top (workers/cpu_cores.py), and would still be preempted there
    by the serving path otherwise. Skipped when the engines need every core, or on a GPU."""
    from workers.cpu_cores import NODE_CORES_ENV, frontend_cores

    if not config.engine.pin_cores or config.num_gpus_per_replica > 0:
        return
    cores = os.sched_getaffinity(0)
    frontend = frontend_cores(cores, config.max_replicas() * config.engine.threads())
    if frontend is None:
        return
    os.environ[NODE_CORES_ENV] = ",".join(map(str, sorted(cores)))
    os.sched_setaffinity(0, frontend)


def drain(timeout_s: float) -> None:
    """Let requests in flight finish (new ones get 503) before Serve shuts down: serve.shutdown() alone
    stops the HTTP proxy at once and cuts every open stream. A second signal skips the wait."""
    from ray import serve

    print(f"draining: requests in flight may run for up to {timeout_s:.0f} s; new ones get 503", flush=True)
    try:
        ingress = serve.get_deployment_handle("OpenAIIngress", app_name="entropic")
        left = ingress.drain.remote(timeout_s).result(timeout_s=timeout_s + 10)
        print(f"drained ({left} request(s) still in flight)", flush=True)
    except KeyboardInterrupt:
        print("drain skipped", flush=True)
    except Exception as exc:  # the ingress is gone already: nothing left to drain
        print(f"drain failed: {type(exc).__name__}: {exc}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
