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
import sys
import threading
import time
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from controller.laws.entropic_time import EntropyTrace
from workers.control_params import EntropicArgs
from workers.errors import InvalidRequest, ReplicaUnavailable, RequestFailed, RequestMoved
from workers.pruning_state import STATE as PRUNING
from workers.step_threads import StepThreads, on_passing_thread, set_torch_threads, wrap_forward

logger = logging.getLogger(__name__)


# Our choices a user may override from the environment; the rest are how this module drives vLLM.
_OVERRIDABLE = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "VLLM_USE_AOT_COMPILE", "TOKENIZERS_PARALLELISM",
                "THP_MEM_ALLOC_ENABLE")


def engine_process_env(cpu_threads: int, kv_cache_space_gib: int,
                       overrides: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment vLLM reads at import, for a process that runs one in-process engine; ``overrides``: where a
    user's own values of the overridable variables are read (this process's environment by default).

    * ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core, scheduler and logits processors live in
      this process (see the module docstring).
    * ``nobind`` and exactly ``cpu_threads`` OpenMP threads: with vLLM's default thread binding, two
      engines (or an engine and a busy process) on the same cores stalled steps from ~65 ms to over 1 s.
    * ``VLLM_USE_AOT_COMPILE=1`` (vLLM's default, said here because it is ours too): a start with the
      configuration of an earlier one loads the compiled model that start saved, without tracing it again.
      On CPU that load needs ``workers.aot_cache``, which the runner installs (docs/operations.md, start-up).
    * ``THP_MEM_ALLOC_ENABLE=0`` (torch's default, said here because a user may override it): the kernel's
      default pages, as ``vllm serve`` has them. Transparent huge pages (``1``: torch aligns allocations of
      2 MiB and more and asks for them) made no difference to step times beyond the spread on two CPU
      families, shortened the engine's start by 5% on one and made it twice as long on the other: vLLM zeroes
      its whole KV cache at start, and there each huge page faulted in slower than 512 small ones
      (docs/operations.md, start-up; docs/results/). Read once, at torch's first allocation: a user's value
      must be in the environment before torch is imported.
    """
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": str(cpu_threads),
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_space_gib),
        "VLLM_USE_AOT_COMPILE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "THP_MEM_ALLOC_ENABLE": "0",
    }
    user = os.environ if overrides is None else overrides
    return {k: user.get(k, v) if k in _OVERRIDABLE else v for k, v in env.items()}


# The overridable variables as this process had them before configure_process_env first set any: a value it
# set for an earlier engine of the process is not a user's override for the next.
_USER_ENV: dict[str, str] | None = None


def configure_process_env(cpu_threads: int, kv_cache_space_gib: int) -> None:
    """Apply ``engine_process_env`` to this process, before its next engine starts (before vllm is imported,
    for the variables read at import)."""
    global _USER_ENV
    if _USER_ENV is None:
        _USER_ENV = {k: os.environ[k] for k in _OVERRIDABLE if k in os.environ}
    os.environ.update(engine_process_env(cpu_threads, kv_cache_space_gib, _USER_ENV))
    vllm_envs = sys.modules.get("vllm.envs")
    if vllm_envs is not None:
        # vllm 0.32.0 freezes its environment once an engine has started (EngineCore.__init__ calls
        # enable_envs_cache): a later engine of this process would start with the first one's KV-cache size.
        vllm_envs.disable_envs_cache()
    set_torch_threads(cpu_threads)


# One position's logprobs as vLLM returned them, as plain data: (token id, logprob, rank, decoded text) for the
# position's own token first, then the top tokens by rank (vLLM's order; the own token appears once if it is
# among them). Logprobs are of the engine's ``logprobs_mode`` distribution (workers/config.py).
PositionLogprobs = tuple[tuple[int, float, "int | None", "str | None"], ...]


@dataclass(frozen=True)
class EpicStep:
    """How one EPIC token was drawn (workers.epic): the lookahead entropy of the chosen token where it was
    estimated, how many candidates' lookaheads were estimated, the rollout tokens spent on it, and whether
    the draw was exact (false where the request's rollout budget cut the search short or was spent)."""

    lookahead_entropy: float | None
    candidates_evaluated: int
    rollout_tokens: int
    exact: bool


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
    stop_prob: float | None = None  # probability mass on stop tokens at the latest step (telemetry)
    logprobs: list[PositionLogprobs] | None = None  # one per new token, when the params asked for logprobs
    # The prompt's, when the params asked for prompt_logprobs (the first position has none); arrives once
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    prompt_token_ids: list[int] | None = None  # the prompt as the engine saw it, on the request's first delta
    epic: list[EpicStep] | None = None  # one per new token of an entropy-aligned (EPIC) request


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
    prompt_sent: bool = False
    engine_id: str | None = None  # vLLM's internal id of it (the key with a suffix), once added


# (step wall seconds, estimator seconds in that step, deltas the step produced, whether the step only
# decoded: every request it ran produced a token and none produced its first, so no prompt was prefilled)
StepObserver = Callable[[float, float, list["Delta"], bool], None]


class EngineRunner:
    """Owns one vLLM ``LLMEngine`` and the thread that steps it.

    Failure isolation: a request's parameters are checked against the model (vLLM's own
    ``SamplingParams.verify``) before they reach the engine thread, and anything a single request
    raises there (adding it, delivering its output) fails that request alone, never the loop. Only
    an exception from ``engine.step()`` itself stops the loop: the engine's state is then unknown,
    so every stream gets an error at once, ``alive`` turns false and ``on_fatal`` is called.
    """

    def __init__(self, engine_kwargs: dict[str, Any], on_step: StepObserver | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None, logits_processors: Sequence[type] = (),
                 telemetry: bool = True, on_abort: Callable[[str], None] | None = None,
                 step_threads: StepThreads | None = None, cpu_sampler: str = "inverse_cdf") -> None:
        """``telemetry`` False: no entropy logits processor (every ``Delta`` has empty entropy).
        ``logits_processors``: more processors, in the order vLLM applies them; ours runs first unless the
        list names ``EntropicLogitsProcessor`` elsewhere.
        ``step_threads``: prefill steps' forward passes borrow the serving path's cores (CPU, pinned).
        ``cpu_sampler``: ``EngineConfig.cpu_sampler``."""
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine
        from vllm.v1.request import RequestStatus

        from workers.aot_cache import load_inductor_artifacts
        from workers.sampling import EntropicLogitsProcessor

        processors = [p for p in logits_processors if p is not EntropicLogitsProcessor]
        if telemetry:
            given = list(logits_processors)
            processors.insert(given.index(EntropicLogitsProcessor) if EntropicLogitsProcessor in given else 0,
                              EntropicLogitsProcessor)
        import torch

        def build() -> tuple[Any, int]:
            load_inductor_artifacts()  # before vLLM compiles or loads the model
            engine = LLMEngine.from_engine_args(EngineArgs(logits_processors=processors, **engine_kwargs))
            processed_logprobs_only_when_asked(model_runner(engine).sampler)
            if cpu_sampler == "inverse_cdf":
                from workers.cpu_sampler import inverse_cdf_sampling, sparse_penalties

                runner = model_runner(engine)
                if inverse_cdf_sampling(runner.sampler, runner.input_batch.logitsprocs):
                    sparse_penalties(runner.sampler)
            return engine, torch.get_num_threads()

        # Built on a thread that ends, so that the only OpenMP pool left is the stepping thread's (on_passing_thread
        # says why), at the caller's thread count; the stepping thread takes the count the build ended with.
        self.engine, self._omp_threads = on_passing_thread(build, torch.get_num_threads())
        self.step_threads = step_threads
        if step_threads is not None:
            wrap_forward(self.engine, step_threads)
        self.processor = find_logits_processor(self.engine, EntropicLogitsProcessor) if telemetry else None
        self.tokenizer = self.engine.get_tokenizer()
        self.max_model_len = self.engine.model_config.max_model_len
        self._on_step = on_step
        self._on_fatal = on_fatal
        self._on_abort = on_abort  # called with why a request ended early: client_gone, failed, engine_stopped
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        # this step's deltas by the event loop of their stream, posted together after it
        self._outbox: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, Delta]]] = {}
        self._lock = threading.Lock()  # registering a stream vs. failing them all when the loop dies
        self._stop = threading.Event()
        self.fatal: BaseException | None = None
        self.steps = 0
        # Keys of requests in the engine's waiting queue with nothing computed yet, as of the last step: they can
        # move to another replica and lose no work (set by the engine thread, read by the control step)
        self.unstarted: frozenset[str] = frozenset()
        self._waiting_status = RequestStatus.WAITING
        self.heartbeat = time.monotonic()  # last time the loop went round (idle waits included)
        self._thread = threading.Thread(target=self._loop, name="vllm-engine", daemon=True)
        self._thread.start()

    @property
    def estimator_seconds(self) -> float:
        """Time the entropy processor has spent estimating, cumulative."""
        return self.processor.estimator_seconds if self.processor is not None else 0.0

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.fatal is None

    def stalled_for(self) -> float:
        """Seconds since the loop last went round; large while alive means one step is stuck."""
        return time.monotonic() - self.heartbeat

    @property
    def scheduler(self) -> Any:
        return self.engine.engine_core.engine_core.scheduler

    def scheduler_counts(self) -> tuple[int, int]:
        return len(self.scheduler.running), len(self.scheduler.waiting)

    def kv_tokens(self) -> tuple[int, int]:
        """(free, total) KV cache in tokens. Free blocks include cached prefixes no request holds: vLLM
        evicts those for a new request, so they are room."""
        scheduler = self.scheduler
        pool = scheduler.kv_cache_manager.block_pool
        return pool.get_num_free_blocks() * scheduler.block_size, pool.num_gpu_blocks * scheduler.block_size

    # --- caller side -----------------------------------------------------------------
    def validate(self, params: Any) -> None:
        """vLLM's own checks of a request against this model (token ids in ``stop_token_ids``,
        ``logit_bias``, ``allowed_token_ids``, logprobs limits, structured-output specs), run in the
        caller's thread so a bad request is refused before the engine thread ever sees it."""
        from vllm.exceptions import VLLMClientError

        config = self.engine.vllm_config
        try:
            params.verify(self.engine.model_config, config.speculative_config,
                          config.structured_outputs_config, self.tokenizer)
        except (VLLMClientError, ValueError, TypeError, OverflowError) as exc:
            raise _client_error(exc) from None

    async def generate(self, request_id: str, prompt: Any, params: Any, prompt_tokens: int) -> AsyncGenerator[Delta, None]:
        loop = asyncio.get_running_loop()
        args = EntropicArgs.of(params)
        stream = _Stream(loop, asyncio.Queue(), request_id, time.monotonic(), prompt_tokens,
                         pruning=args.pruning if args is not None else None)
        with self._lock:
            if not self.alive:
                raise ReplicaUnavailable("this replica's engine has stopped; it is being replaced")
            self._streams[request_id] = stream
        self._commands.put(lambda: self._add(stream, prompt, params))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine thread has already let go of it
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:  # caller went away or failed: free the engine's slot
                self._commands.put(lambda: self._abort(request_id))

    def move(self, key: str, replica_id: str) -> None:
        """Hand the request back for ``replica_id`` (its stream ends with ``RequestMoved``) if it is still
        waiting with nothing computed when the engine thread gets to it; otherwise it stays."""
        self._commands.put(lambda: self._move(key, replica_id))

    def stop_with_error(self, exc: BaseException) -> None:
        """Stop the loop as if a step had raised ``exc`` (fault injection: chaos tests, drills)."""
        def fail() -> None:
            raise exc

        self._commands.put(fail)

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        if self.step_threads is not None and not self._thread.is_alive():
            self.step_threads.close()

    # --- engine thread -----------------------------------------------------------------
    def _add(self, stream: _Stream, prompt: Any, params: Any) -> None:
        if stream.key not in self._streams:
            return  # the caller left before the engine got to it
        try:
            stream.engine_id = self.engine.add_request(stream.key, prompt, params)
        except Exception as exc:  # whatever one request raises fails that request, not the loop
            from vllm.exceptions import VLLMClientError

            if isinstance(exc, (VLLMClientError, ValueError, TypeError, OverflowError)):
                self._fail(stream.key, _client_error(exc))
            else:
                logger.exception("adding request %s failed", stream.key)
                self._fail(stream.key, RequestFailed("the engine could not accept this request"))

    def _fail(self, request_id: str, error: BaseException) -> None:
        """End one request with ``error``, releasing whatever the engine holds for it."""
        stream = self._streams.pop(request_id, None)
        try:  # the request may be half-added (output processor but not core): abort is a no-op otherwise
            self.engine.abort_request([request_id])
        except Exception:
            logger.exception("aborting request %s failed", request_id)
        self._forget(request_id)
        if stream is not None:
            _hand(stream, error)
        self._ended_early("invalid" if isinstance(error, InvalidRequest) else "failed")

    def _is_unstarted(self, stream: _Stream) -> bool:
        if stream.prompt_sent or stream.engine_id is None:
            return False
        request = self.scheduler.requests.get(stream.engine_id)
        return request is not None and request.status == self._waiting_status and not request.num_computed_tokens

    def _move(self, key: str, replica_id: str) -> None:
        stream = self._streams.get(key)
        if stream is None or not self._is_unstarted(stream):
            return  # it has started (or ended) since the telemetry the decision came from
        del self._streams[key]
        self.engine.abort_request([key])
        self._forget(key)
        _hand(stream, RequestMoved(key, replica_id))
        self._ended_early("moved")

    def _unstarted_now(self) -> frozenset[str]:
        if not self.scheduler.waiting:
            return frozenset()
        return frozenset(k for k, s in self._streams.items() if self._is_unstarted(s))

    def _abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            self.engine.abort_request([request_id])
            self._forget(request_id)
            self._ended_early("client_gone")

    def _ended_early(self, reason: str) -> None:
        if self._on_abort is not None:
            self._on_abort(reason)
        if not self.engine.has_unfinished_requests():
            self._refresh_stats()

    def _refresh_stats(self) -> None:
        """Record the scheduler's state now. vLLM records its gauges (running, waiting, KV-cache use) only
        at a step, so after the last request of a replica is aborted they would keep their last values
        until the next request arrived."""
        manager = getattr(self.engine, "logger_manager", None)
        if manager is None:
            return
        stats = self.scheduler.make_stats()
        if stats is not None:
            manager.record(scheduler_stats=stats, iteration_stats=None)

    def _forget(self, key: str) -> None:
        if self.processor is not None:
            self.processor.forget(key)
        PRUNING.forget(key)

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
        name_os_thread("vllm-engine")
        try:
            if self.step_threads is not None:
                self.step_threads.start()  # this thread's OpenMP pool, before the first step
            else:
                set_torch_threads(self._omp_threads)
            while not self._stop.is_set():
                self.heartbeat = time.monotonic()
                self._drain_commands()
                if not self.engine.has_unfinished_requests():
                    self.unstarted = frozenset()
                    continue
                started = time.perf_counter()
                estimator_before = self.estimator_seconds
                outputs = self.engine.step()
                self.steps += 1
                step_seconds = time.perf_counter() - started
                produced = [d for d in (self._deliver_isolated(o) for o in outputs) if d is not None]
                self._post()
                self.unstarted = self._unstarted_now()
                if self._on_step is not None:
                    # A request still in the scheduler's running list that produced nothing was prefilling a chunk
                    decode_only = bool(produced) and len(produced) >= len(self.scheduler.running) and all(
                        d.completion_tokens > len(d.token_ids) for d in produced)
                    try:
                        self._on_step(step_seconds, self.estimator_seconds - estimator_before, produced, decode_only)
                    except Exception:  # observers must never stop serving
                        logger.exception("step observer failed")
        except BaseException as exc:  # the engine's state is unknown: stop, and say so to everyone at once
            logger.exception("engine loop stopped")
            self._die(exc)

    def _die(self, exc: BaseException) -> None:
        with self._lock:
            self.fatal = exc
            streams, self._streams = self._streams, {}
        for stream in streams.values():  # before its first output the ingress may retry it elsewhere
            _hand(stream, ReplicaUnavailable("the engine on this replica failed before the request finished"))
            if self._on_abort is not None:
                self._on_abort("engine_stopped")
        if self._on_fatal is not None:
            try:
                self._on_fatal(exc)
            except Exception:
                logger.exception("engine failure callback failed")

    def _deliver_isolated(self, output: Any) -> Delta | None:
        try:
            return self._deliver(output)
        except Exception:
            logger.exception("delivering output of request %s failed", output.request_id)
            self._fail(output.request_id, RequestFailed("the engine failed while producing this request's output"))
            return None

    def _deliver(self, output: Any) -> Delta | None:
        stream = self._streams.get(output.request_id)
        if stream is None:
            return None
        completion = output.outputs[0]
        new_ids = list(completion.token_ids)
        records = (self.processor.records(stream.key) if self.processor is not None else [])[
            stream.emitted : stream.emitted + len(new_ids)]
        entropy = [h for h, _ in records]
        temperature = [t for _, t in records]
        for h in entropy:
            stream.trace.add(h)
        kv_blocks: list[tuple[int, int]] = []
        if stream.pruning is not None:
            self._feed_surprisal(stream, output, completion)
            kv_blocks = PRUNING.drain_kept(stream.key)
        first, stream.prompt_sent = not stream.prompt_sent, True
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
            stop_prob=self.processor.stop_prob(stream.key) if self.processor is not None else None,
            logprobs=None if completion.logprobs is None else [_position(p) for p in completion.logprobs],
            prompt_logprobs=None if not output.prompt_logprobs else [
                None if p is None else _position(p) for p in output.prompt_logprobs],
            prompt_token_ids=list(output.prompt_token_ids or []) if first else None,
        )
        if output.finished:
            self._streams.pop(output.request_id, None)
            self._forget(stream.key)
        self._outbox.setdefault(stream.loop, []).append((stream, delta))
        return delta

    def _post(self) -> None:
        """Hand a step's deltas to their event loops, one wake-up per loop per step (each
        ``call_soon_threadsafe`` writes to the loop's self-pipe). A loop that has closed cannot take them:
        its requests are aborted here, where raising would stop the engine for every request."""
        outbox, self._outbox = self._outbox, {}
        for loop, items in outbox.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that loop has closed: nobody is left to read these requests, free them
                for stream, _ in items:
                    self._abort(stream.key)

    def _feed_surprisal(self, stream: _Stream, output: Any, completion: Any) -> None:
        """Token surprisal -log p(x_i | x_<i) from vLLM's raw logprobs, for the block scores."""
        assert stream.pruning is not None  # only pruned requests are fed
        track = PRUNING.request(stream.key, stream.pruning)
        block_size = self.engine.vllm_config.cache_config.block_size
        prompt = output.prompt_logprobs
        if prompt:  # DELTA outputs: each piece continues where the last ended
            track.add_surprisal(stream.prompt_surprisal_seen, [_surprisal(e) for e in prompt], block_size)
            stream.prompt_surprisal_seen += len(prompt)
        if completion.logprobs:
            values = [_surprisal(entry) for entry in completion.logprobs]
            track.add_surprisal(stream.prompt_tokens + stream.emitted, values, block_size)


def _hand(stream: _Stream, item: BaseException) -> None:
    """One stream's last item; a caller whose loop has closed is past hearing it."""
    try:
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
    except RuntimeError:
        pass


def _put_all(items: list[tuple[_Stream, Delta]]) -> None:
    for stream, delta in items:
        stream.queue.put_nowait(delta)


def name_os_thread(name: str) -> None:
    """Give the calling thread an OS-level name, so ``top -H``, ``py-spy`` and ``/proc/<pid>/task/*/comm`` can
    tell the engine thread from Ray's threads in a replica process (Linux; elsewhere a no-op)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _position(entry: Any) -> PositionLogprobs:
    return tuple((token_id, lp.logprob, lp.rank, lp.decoded_token) for token_id, lp in entry.items())


def _surprisal(entry: Any) -> float | None:
    if not entry:
        return None  # the first prompt token has no conditional probability
    return -next(iter(entry.values())).logprob


def _client_error(exc: BaseException) -> InvalidRequest:
    """vLLM's refusal as our 400: its message without the rejected value (which may be huge)."""
    message = str(exc.args[0]) if exc.args else type(exc).__name__
    return InvalidRequest(message, getattr(exc, "parameter", None))


def model_runner(engine: Any) -> Any:
    """The in-process engine's model runner (vllm 0.32.0 object layout)."""
    return engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


def find_logits_processor(engine: Any, cls: type) -> Any:
    """The engine's instance of our logits processor."""
    runner = model_runner(engine)
    found = [p for p in runner.input_batch.logitsprocs.all if isinstance(p, cls)]
    if len(found) != 1:
        raise RuntimeError(f"expected one {cls.__name__} in the engine, found {len(found)}")
    return found[0]


def processed_logprobs_only_when_asked(sampler: Any) -> None:
    """Have vLLM's sampler compute processed logprobs only in steps whose batch asked for logprobs.

    With ``logprobs_mode`` processed_logprobs (our default, workers/config.py), vLLM's top-k/top-p stage
    of random sampling computes a [rows, vocab] log-softmax in every step, whether or not a request asked
    (its greedy path checks first; vllm 0.32.0): a pass over the logits plus an allocation per step that
    `vllm serve`, in its default raw_logprobs mode, never pays. The same check as the greedy path's, made
    per step on the instance: the same tokens and the same logprobs."""
    inner = sampler.topk_topp_sampler
    mode = inner.logprobs_mode
    if mode not in ("processed_logprobs", "processed_logits"):
        return  # raw modes compute logprobs only when asked already
    sample = sampler.sample

    def sample_asking_only_when_asked(logits: Any, sampling_metadata: Any, logprobs_mode_override: Any = None) -> Any:
        asked = sampling_metadata.max_num_logprobs is not None or bool(sampling_metadata.logprob_token_ids)
        inner.logprobs_mode = mode if asked else "raw_logprobs"  # raw: the top-k/top-p stage returns none
        return sample(logits, sampling_metadata, logprobs_mode_override)

    sampler.sample = sample_asking_only_when_asked
