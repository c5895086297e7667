"""In-process vLLM engine driven by one thread, streaming per-request deltas to asyncio callers.

Written for vllm 0.32.0. ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps the engine core, the
scheduler and the logits processors in this process, so telemetry is read straight off
the logits processor between steps. ``LLMEngine`` is not thread-safe: only the engine
thread touches it; callers hand it closures through a queue.
"""
from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from controller.laws.entropic_time import EntropyTrace
from workers.pruning_state import STATE as PRUNING

logger = logging.getLogger(__name__)


def configure_process_env(cpu_threads: int, kv_cache_space_gib: int) -> None:
    """Environment vLLM reads at import: must run before vllm is imported in this process.

    With vLLM's default thread binding, two engines (or an engine and a busy process) on
    the same cores stalled steps from ~65 ms to over 1 s; each replica therefore runs an
    unbound OpenMP pool of exactly ``cpu_threads`` threads.
    """
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ["OMP_NUM_THREADS"] = str(cpu_threads)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_space_gib))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    torch.set_num_threads(cpu_threads)


class EngineRequestError(ValueError):
    """The engine refused a request (vLLM's own validation): a client error."""


@dataclass
class Delta:
    """What one engine step produced for one request (picklable: crosses Serve handles)."""

    token_ids: list[int]
    text: str
    entropy: list[float]
    temperature: list[float]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    entropic_time: float
    mean_entropy: float
    entropy_variance: float
    kv_blocks: list[tuple[int, int]] = field(default_factory=list)  # (kept, total) per pruned-path decode step


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    key: str
    arrival: float
    prompt_tokens: int
    emitted: int = 0
    trace: EntropyTrace = field(default_factory=EntropyTrace)
    pruning: dict[str, Any] | None = None  # the request's pruning args (workers.pruning_state)
    prompt_surprisal_seen: int = 0


# (step wall seconds, estimator seconds in that step, deltas the step produced)
StepObserver = Callable[[float, float, list["Delta"]], None]


class EngineRunner:
    def __init__(self, engine_kwargs: dict[str, Any], on_step: StepObserver | None = None) -> None:
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        from workers.sampling import EntropicLogitsProcessor

        self.engine = LLMEngine.from_engine_args(
            EngineArgs(logits_processors=[EntropicLogitsProcessor], **engine_kwargs)
        )
        self.processor = find_logits_processor(self.engine, EntropicLogitsProcessor)
        self.tokenizer = self.engine.get_tokenizer()
        self.max_model_len = self.engine.model_config.max_model_len
        self._on_step = on_step
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._stop = threading.Event()
        self.fatal: BaseException | None = None
        self.steps = 0
        self._thread = threading.Thread(target=self._loop, name="vllm-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.fatal is None

    @property
    def scheduler(self) -> Any:
        return self.engine.engine_core.engine_core.scheduler

    def scheduler_counts(self) -> tuple[int, int]:
        return len(self.scheduler.running), len(self.scheduler.waiting)

    # --- caller side -----------------------------------------------------------------
    async def generate(self, request_id: str, prompt: Any, params: Any, prompt_tokens: int) -> AsyncIterator[Delta]:
        if not self.alive:
            raise RuntimeError("engine loop is not running") from self.fatal
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue(), request_id, time.monotonic(), prompt_tokens,
                         pruning=((getattr(params, "extra_args", None) or {}).get("entropic") or {}).get("pruning"))

        def add() -> None:
            try:
                self.engine.add_request(request_id, prompt, params)
            except (ValueError, TypeError) as exc:
                loop.call_soon_threadsafe(stream.queue.put_nowait, EngineRequestError(str(exc)))
                return
            self._streams[request_id] = stream

        self._commands.put(add)
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:  # caller went away or failed: free the engine's slot
                self._commands.put(lambda: self._abort(request_id))

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    # --- engine thread -----------------------------------------------------------------
    def _abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            self.engine.abort_request([request_id])
            self.processor.forget(request_id)
            PRUNING.forget(request_id)

    def _drain_commands(self) -> None:
        block = not self.engine.has_unfinished_requests()
        while True:
            try:
                command = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
            except queue.Empty:
                return
            block = False
            command()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._drain_commands()
            if not self.engine.has_unfinished_requests():
                continue
            started = time.perf_counter()
            estimator_before = self.processor.estimator_seconds
            try:
                outputs = self.engine.step()
            except BaseException as exc:  # the engine is broken: fail every stream, stop
                logger.exception("engine step failed")
                self.fatal = exc
                for stream in self._streams.values():
                    stream.loop.call_soon_threadsafe(stream.queue.put_nowait, RuntimeError(f"engine failed: {exc!r}"))
                self._streams.clear()
                return
            self.steps += 1
            step_seconds = time.perf_counter() - started
            produced = [d for d in (self._deliver(o) for o in outputs) if d is not None]
            if self._on_step is not None:
                try:
                    self._on_step(step_seconds, self.processor.estimator_seconds - estimator_before, produced)
                except Exception:  # observers must never stop serving
                    logger.exception("step observer failed")

    def _deliver(self, output: Any) -> Delta | None:
        stream = self._streams.get(output.request_id)
        if stream is None:
            return None
        completion = output.outputs[0]
        new_ids = list(completion.token_ids)
        records = self.processor.records(stream.key)[stream.emitted : stream.emitted + len(new_ids)]
        entropy = [h for h, _ in records]
        temperature = [t for _, t in records]
        for h in entropy:
            stream.trace.add(h)
        kv_blocks: list[tuple[int, int]] = []
        if stream.pruning is not None:
            self._feed_surprisal(stream, output, completion)
            kv_blocks = PRUNING.drain_kept(stream.key)
        stream.emitted += len(new_ids)
        delta = Delta(
            token_ids=new_ids,
            text=completion.text,
            entropy=entropy,
            temperature=temperature,
            finished=output.finished,
            finish_reason=completion.finish_reason if output.finished else None,
            prompt_tokens=stream.prompt_tokens,
            completion_tokens=stream.emitted,
            entropic_time=stream.trace.tau,
            mean_entropy=stream.trace.mean,
            entropy_variance=stream.trace.variance,
            kv_blocks=kv_blocks,
        )
        if output.finished:
            self._streams.pop(output.request_id, None)
            self.processor.forget(stream.key)
            PRUNING.forget(stream.key)
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, delta)
        return delta


    def _feed_surprisal(self, stream: _Stream, output: Any, completion: Any) -> None:
        """Token surprisal -log p(x_i | x_<i) from vLLM's raw logprobs, for the block scores."""
        track = PRUNING.request(stream.key, stream.pruning)
        block_size = self.engine.vllm_config.cache_config.block_size
        prompt = output.prompt_logprobs
        if prompt:  # DELTA outputs: each piece continues where the last ended
            track.add_surprisal(stream.prompt_surprisal_seen, [_surprisal(e) for e in prompt], block_size)
            stream.prompt_surprisal_seen += len(prompt)
        if completion.logprobs:
            values = [_surprisal(entry) for entry in completion.logprobs]
            track.add_surprisal(stream.prompt_tokens + stream.emitted, values, block_size)


def _surprisal(entry: Any) -> float | None:
    if not entry:
        return None  # the first prompt token has no conditional probability
    return -next(iter(entry.values())).logprob


def find_logits_processor(engine: Any, cls: type) -> Any:
    """The engine's instance of our logits processor (vllm 0.32.0 object layout)."""
    runner = engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    found = [p for p in runner.input_batch.logitsprocs.all if isinstance(p, cls)]
    if len(found) != 1:
        raise RuntimeError(f"expected one {cls.__name__} in the engine, found {len(found)}")
    return found[0]
