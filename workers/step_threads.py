"""OpenMP threads per engine step on CPU: a step with much work borrows the serving path's core.

Why: a pinned engine runs ``cpu_threads`` OpenMP threads on cores of its own, and the node's lowest core
stays with the serving path (workers/cpu_cores.py), as vLLM's CPU worker leaves one to its API server. A
step that prefills hundreds of tokens is compute-bound matmuls, which another core nearly halves, and
while it runs the serving path has little to do: its tokens stream only when it ends. So the forward pass
of a step that schedules at least ``min_tokens`` tokens also runs threads on the borrowed cores.

A decode step gains from a second core too, on a bare engine; served, it did not, and was sometimes slower
(the earlier served runs with the borrowing worker sleeping after each region, ``on_passing_thread`` and
workers/process.py's ``_pin`` say why; a later one without that gained nothing that held over its rounds).
Likely (not measured directly): a stream of decode steps keeps the serving path relaying tokens on the
lent core, and every parallel region of the step waits for the OpenMP thread that shares it. So
borrowing by context (``min_context``: a step whose sequences hold at least that many tokens in all) is off
unless configured; what it changed served is in docs/results/ (the serve rows). Every other step runs on
the engine's own cores.

A core is lent to one engine at a time: a step borrows only the cores whose lock it takes at once
(``flock``, never waiting), so engines sharing a node never stack their threads on one core; a step that
finds a core lent runs without it.

How the threads get there: libgomp keeps a pool of worker threads per thread that starts parallel regions,
created with that thread's CPU affinity at the time. The engine thread, pinned with its process to its
own cores, widens its affinity to the borrowed cores too, runs one parallel region at full width so that
its pool exists, and narrows back: the pool's workers may run on the borrowed cores, the engine thread
may not. oneDNN sizes a matmul's parallelism when its primitive is created (during the engine's warm-up),
so the engine process starts with the full thread count (``max_threads``) and steps that do not borrow
set it down to the engine's own.
"""
from __future__ import annotations

import fcntl
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from workers.cpu_cores import default_lock_dir, try_lock

logger = logging.getLogger(__name__)

T = TypeVar("T")


def on_passing_thread(work: Callable[[], T], threads: int, name: str = "engine-build") -> T:
    """``work()`` run at ``threads`` OpenMP threads on a thread of its own, which ends when it returns.

    Why: libgomp keeps a pool of worker threads for each thread that has started a parallel region, for as
    long as that thread lives, and while its pools together hold more threads than the process has CPUs, a
    worker spins ~100 times instead of ~300000 (GOMP_SPINCOUNT's default) before it sleeps on a futex after a
    region. An engine loaded, compiled and warmed up at N threads on the caller's thread and then stepped on a
    thread of its own leaves the caller's pool idle but counted: every one of a decode step's hundreds of
    parallel regions then sleeps and wakes each worker, where vLLM's engine process, which builds and steps
    on one thread, has one pool that spins. Building on a thread that ends frees its pool with it
    (docs/results/: the passing-build rows). A new thread starts at the OpenMP thread count the runtime
    loaded with, hence ``threads``."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            set_torch_threads(threads)
            box["value"] = work()
        except BaseException as exc:  # re-raised on the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name=name, daemon=True)  # daemon: an interrupted start can still exit
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def set_torch_threads(count: int) -> None:
    import torch

    # vLLM's CPU worker replaces torch.set_num_threads by a function that only warns (vllm 0.32.0,
    # CPUWorker.init_device); the binding itself is what it wraps.
    torch._C.set_num_threads(count)


@dataclass
class StepThreads:
    """The engine thread's OpenMP threads, step by step. ``own_cores``: the cores the engine process claimed
    (one thread each); ``borrowed``: cores it may borrow for a step of at least ``min_tokens`` scheduled
    tokens or, where ``min_context`` is set, that many tokens of context (cached and scheduled, summed over
    its sequences)."""

    own_cores: tuple[int, ...]
    borrowed: tuple[int, ...]
    min_tokens: int
    min_context: int | None
    lock_dir: Path | None = None
    steps_borrowed: int = 0  # forward passes that ran on borrowed cores too
    steps_refused: int = 0  # large steps that found every borrowable core lent to another engine
    _fds: dict[int, int] = field(default_factory=dict, repr=False)  # core -> its lock file, once started
    _taken: list[int] = field(default_factory=list, repr=False)  # cores the running forward pass borrowed

    @property
    def own_threads(self) -> int:
        return len(self.own_cores)

    @property
    def max_threads(self) -> int:
        return len(self.own_cores) + len(self.borrowed)

    def start(self) -> None:
        """On the engine thread, before its first step: create its OpenMP pool over the own and the borrowed
        cores, then keep the engine thread itself on its own cores."""
        import torch

        directory = self.lock_dir or default_lock_dir()
        try:
            directory.mkdir(parents=True, exist_ok=True)
            for core in self.borrowed:
                self._fds[core] = os.open(directory / f"borrow-{core}.lock", os.O_RDWR | os.O_CREAT, 0o600)
            os.sched_setaffinity(0, set(self.own_cores) | set(self.borrowed))
        except OSError as exc:  # serve on the own cores rather than not at all
            logger.warning("engine thread borrows no cores: %s", exc)
            self.close()
            self.borrowed = ()
            return
        set_torch_threads(self.max_threads)
        torch.ones(1 << 22).sum()  # one parallel region at full width (at::parallel_for's grain: 32768)
        os.sched_setaffinity(0, set(self.own_cores))
        set_torch_threads(self.own_threads)

    def borrow(self, scheduled_tokens: int, context_tokens: int = 0) -> int:
        """Before a forward pass of ``scheduled_tokens`` tokens over ``context_tokens`` of context: how many
        cores it borrowed (their locks are then held until ``give_back``); 0 for a small step or when every
        borrowable core is lent."""
        small = scheduled_tokens < self.min_tokens and (self.min_context is None or context_tokens < self.min_context)
        if small or not self._fds:
            return 0
        taken = [core for core, fd in self._fds.items() if try_lock(fd)]
        if not taken:
            self.steps_refused += 1
            return 0
        self._taken = taken
        self.steps_borrowed += 1
        set_torch_threads(self.own_threads + len(taken))
        return len(taken)

    def give_back(self) -> None:
        """After a forward pass that borrowed: the engine's own threads again, and the cores free to lend."""
        set_torch_threads(self.own_threads)
        for core in self._taken:
            fcntl.flock(self._fds[core], fcntl.LOCK_UN)
        self._taken = []

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def borrowable_cores(node: set[int], own: tuple[int, ...], reserve: int) -> tuple[int, ...]:
    """The cores an engine pinned to ``own`` may borrow: the ``reserve`` lowest of its ``node``'s, which no
    engine claims (the serving path's)."""
    return tuple(core for core in sorted(node)[:reserve] if core not in own)


def context_tokens(scheduler_output: Any) -> int:
    """The tokens a step's sequences attend over: those cached before it and those it schedules."""
    cached = sum(scheduler_output.scheduled_cached_reqs.num_computed_tokens)
    new = sum(request.num_computed_tokens for request in scheduler_output.scheduled_new_reqs)
    return cached + new + scheduler_output.total_num_scheduled_tokens


def wrap_forward(engine: Any, threads: StepThreads) -> None:
    """Run each forward pass of ``engine`` (an in-process ``LLMEngine``) at the threads its size calls for.

    vllm 0.32.0's ``EngineCore.step`` calls ``model_executor.execute_model(scheduler_output, non_block=True)``
    on the stepping thread (the uniprocess executor runs it there and returns a finished future), then
    ``sample_tokens``; only the first is widened."""
    executor = engine.engine_core.engine_core.model_executor
    execute = executor.execute_model

    def execute_model(scheduler_output: Any, non_block: bool = False) -> Any:
        if not threads.borrow(scheduler_output.total_num_scheduled_tokens, context_tokens(scheduler_output)):
            return execute(scheduler_output, non_block)
        try:
            return execute(scheduler_output, non_block)
        finally:
            threads.give_back()

    executor.execute_model = execute_model
