"""One replica's core in a child process of its own, driven from the Serve replica through a pipe.

Why: a Serve replica's process is busy with more than the engine: Ray's core-worker threads, Serve's
event loop streaming every delta to the ingress, routing-stats polls, health checks. Inductor's CPU
kernels and the engine's Python between kernels need the GIL, so in one process the engine thread
waited for it while a core sat idle (docs/design/engine-embedding.md, the measurements behind it). In
the child the engine thread shares its GIL only with the core's own control step and this module's
relay; the engine, the scheduler, the logits processors and the pruned attention stay in one process,
so everything ``workers.engine`` reads in place is still read in place.

``CoreProcess`` (parent side) offers the calls a deployment needs: ``generate`` (an async stream of
``Delta``), ``info``, ``routing_stats``, ``health_problem``, ``inject_fault``. The child runs one
``ReplicaCore`` on an asyncio loop. Messages are pickled tuples on a duplex pipe:

* parent → child: ``("generate", cid, kind, request, overrides, key)``, ``("cancel", cid)``,
  ``("call", cid, name)``, ``("answer", rid, ControllerAnswer | None)``, ``("stop",)``;
* child → parent: ``("ready",)``, ``("start_failed", message)``, ``("delta", cid, Delta)``,
  ``("end", cid)``, ``("raise", cid, RequestError)``, ``("result", cid, ok, value)``,
  ``("report", rid, TelemetryReport)`` (the parent forwards it to the controller and sends the answer
  back), ``("fatal", message)`` (the engine loop stopped).

The child exits when the pipe closes, so it never outlives the replica that started it; when the child
dies, every open stream fails with ``ReplicaUnavailable`` and ``on_fatal`` is called.
"""
from __future__ import annotations

import asyncio
import importlib
import itertools
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from controller.laws.routing import ReplicaLoad
from controller.messages import ControllerAnswer, TelemetryReport
from workers.aio import wait_for
from workers.config import ReplicaConfig
from workers.core import ControllerLink, ReplicaCore
from workers.cpu_cores import RESERVED_CORES, CoreClaim, node_cores, pin_engine_process, pin_this_process
from workers.engine import Delta, configure_process_env, name_os_thread
from workers.errors import ReplicaUnavailable, RequestError, RequestFailed
from workers.step_threads import StepThreads, borrowable_cores

logger = logging.getLogger(__name__)

# A call the child does not answer within this long is treated as unanswered (health, stats); the
# engine thread holds the GIL only between kernels, so a live child answers within one step.
_CALL_TIMEOUT_S = 10.0


class _PipeEnd:
    """One end of the pipe: sends under a lock (the engine thread sends too), and reads on a thread of its
    own, handing each message to ``_dispatch`` on the event loop and, when the other end closes, calling
    ``_closed`` there."""

    _conn: Any
    _loop: asyncio.AbstractEventLoop
    _send_lock: threading.Lock

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            self._conn.send(message)

    def _start_reading(self) -> None:
        threading.Thread(target=self._read, name="engine-process-relay", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            self._loop.call_soon_threadsafe(self._dispatch, message)
        self._loop.call_soon_threadsafe(self._closed)

    def _dispatch(self, message: tuple) -> None:
        raise NotImplementedError

    def _closed(self) -> None:
        raise NotImplementedError


class CoreProcess(_PipeEnd):
    """Parent side: starts the child, relays requests and calls to it, and notices when it dies."""

    def __init__(self, config: ReplicaConfig, *, replica_id: str, node_id: str = "",
                 controller: ControllerLink | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None,
                 preload: tuple[str, ...] = (), while_starting: Callable[[], Any] | None = None,
                 start_timeout_s: float = 3600.0) -> None:
        """Blocks until the child's engine is up (compiling can take minutes); raises if it fails to start.

        ``preload``: modules the child imports before it says it is ready, those whose classes requests
        arrive as. Unpickling the first request would import them otherwise, seconds of CPU (vLLM's protocol
        models) under the first load, on every replica at once. ``while_starting``: this process's own
        start-up work, run once the child is on its way: the child is pinned to the engine's cores, so its
        imports and engine start run there while this one works on the cores left to the serving path."""
        self.config = config
        self.replica_id = replica_id
        self._controller = controller
        self._on_fatal = on_fatal
        self._loop = asyncio.get_running_loop()
        context = multiprocessing.get_context("spawn")  # never fork a process that runs Ray's threads
        self._conn, child_conn = context.Pipe(duplex=True)
        # Daemonic: multiprocessing terminates it when this process exits normally; the pipe's EOF covers the rest.
        self._process = context.Process(target=run_child, name=f"entropic-engine-{replica_id}", daemon=True,
                                        args=(child_conn, config, replica_id, node_id, controller is not None,
                                              preload))
        self._process.start()
        child_conn.close()
        if while_starting is not None:
            while_starting()
        self._send_lock = threading.Lock()
        self._ids = itertools.count()
        self._streams: dict[int, asyncio.Queue] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._gone: BaseException | None = None
        self._stopping = False
        self._await_ready(start_timeout_s)
        self.last_heard = time.monotonic()
        self._start_reading()

    def _await_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(1.0):
            if not self._process.is_alive():
                raise RuntimeError(f"the engine process exited while starting (exit code {self._process.exitcode})")
            if time.monotonic() > deadline:
                self._process.kill()
                raise RuntimeError(f"the engine process did not start within {timeout_s:.0f} s")
        message = self._conn.recv()
        if message[0] != "ready":
            self._process.join(timeout=10)
            raise RuntimeError(f"the engine process failed to start: {message[1]}")

    # --- calls ------------------------------------------------------------------------------------
    async def generate(self, kind: str, request: Any, overrides: dict[str, Any] | None = None,
                       key: str | None = None) -> AsyncIterator[Delta]:
        """``ReplicaCore.generate`` in the child: the same deltas, the same errors."""
        if self._gone is not None:
            raise ReplicaUnavailable("this replica's engine process has stopped; it is being replaced")
        cid = next(self._ids)
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[cid] = queue
        ended = False
        try:
            self._send(("generate", cid, kind, request, overrides, key))
            while True:
                tag, payload = await queue.get()
                if tag == "delta":
                    yield payload
                    continue
                ended = True
                if tag == "raise":
                    raise payload
                return
        finally:
            self._streams.pop(cid, None)
            if not ended and self._gone is None:  # the caller left: the child aborts it in the engine
                self._send(("cancel", cid))

    async def info(self) -> dict[str, Any]:
        return await self._call("info")

    async def routing_stats(self) -> tuple[ReplicaLoad, str | None]:
        """The replica's load and health problem (one round trip; counts as a routing poll)."""
        return await self._call("routing_stats")

    async def health_problem(self) -> str | None:
        """Why this replica cannot serve, or None. A child too busy to answer in time is healthy as long
        as it has said anything within the engine stall timeout; a dead one never is."""
        if self._gone is not None or not self._process.is_alive():
            return f"engine process stopped (exit code {self._process.exitcode}): {self._gone!r}"
        try:
            return await self._call("health_problem")
        except TimeoutError:
            silent = time.monotonic() - self.last_heard
            if silent > self.config.engine_stall_timeout_s:
                return f"engine process has not answered for {silent:.0f} s"
            return None

    async def inject_fault(self) -> None:
        """Stop the child's engine loop from inside, as a crashing step would (fault drills)."""
        await self._call("inject_fault")

    def shutdown(self) -> None:
        self._stopping = True
        try:
            self._send(("stop",))
        except (OSError, ValueError):
            pass
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()
        self._conn.close()

    # --- relay ------------------------------------------------------------------------------------
    async def _call(self, name: str) -> Any:
        if self._gone is not None:
            raise ReplicaUnavailable("this replica's engine process has stopped")
        cid = next(self._ids)
        future = self._loop.create_future()
        self._calls[cid] = future
        try:
            self._send(("call", cid, name))
            return await wait_for(future, _CALL_TIMEOUT_S)
        finally:
            self._calls.pop(cid, None)


    def _dispatch(self, message: tuple) -> None:
        self.last_heard = time.monotonic()
        tag = message[0]
        if tag in ("delta", "end", "raise"):
            queue = self._streams.get(message[1])
            if queue is not None:
                queue.put_nowait((tag, message[2] if len(message) > 2 else None))
        elif tag == "result":
            future = self._calls.get(message[1])
            if future is not None and not future.done():
                _, _, ok, value = message
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(value)
        elif tag == "report":
            self._loop.create_task(self._forward(message[1], message[2]))
        elif tag == "fatal":
            self._fatal(RuntimeError(message[1]))

    async def _forward(self, rid: int, report: TelemetryReport) -> None:
        answer: ControllerAnswer | None = None
        try:
            if self._controller is not None:
                answer = await self._controller(report)
        except Exception as exc:  # the controller is advisory: the child falls back to its own π
            logger.debug("telemetry report failed: %r", exc)
        if self._gone is None:
            self._send(("answer", rid, answer))

    def _closed(self) -> None:  # the child has exited
        if self._gone is not None:
            return
        self._gone = RuntimeError(f"engine process exited (exit code {self._process.exitcode})")
        for queue in self._streams.values():  # before a request's first output the ingress may retry it elsewhere
            queue.put_nowait(("raise", ReplicaUnavailable("the engine on this replica stopped before the request "
                                                          "finished")))
        for future in self._calls.values():
            if not future.done():
                future.set_exception(ReplicaUnavailable("this replica's engine process has stopped"))
        if not self._stopping:
            self._fatal(self._gone)

    def _fatal(self, exc: BaseException) -> None:
        if self._on_fatal is not None:
            try:
                self._on_fatal(exc)
            except Exception:
                logger.exception("engine failure callback failed")


# --- child side -------------------------------------------------------------------------------------
def run_child(conn: Any, config: ReplicaConfig, replica_id: str, node_id: str, with_controller: bool,
              preload: tuple[str, ...] = ()) -> None:
    """Entry point of the engine process, named ``engine-<replica id>`` for ``ps``, ``top`` and ``py-spy``."""
    name_os_thread(f"engine-{replica_id}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    claim, step_threads = _pin(config)  # the claim is held until the process exits
    try:
        asyncio.run(_Child(conn, with_controller).serve(config, replica_id, node_id, preload, step_threads))
    finally:
        if claim is not None:
            claim.release()
        # Skip interpreter teardown: the engine's threads and vLLM's exit hooks have nothing left to save.
        os._exit(0)


def _pin(config: ReplicaConfig) -> tuple[CoreClaim | None, StepThreads | None]:
    """Claim and pin this engine's cores, and say which it may borrow for a large step (workers/step_threads.py)."""
    engine = config.engine
    if not engine.pin_cores:
        return None, None
    # Pinned before torch is imported: until then this process runs where the replica does, on the serving
    # path's cores, which the replica's own start-up keeps busy meanwhile (CoreProcess's while_starting).
    node = node_cores()  # before pinning narrows this process's own affinity
    claim = pin_engine_process(engine.threads())
    own = () if claim is None else claim.cores
    borrowed = borrowable_cores(node, own, RESERVED_CORES) if own and engine.borrow_serving_cores else ()
    if borrowed:
        # libgomp counts the CPUs it may use once, from the affinity it loads with (with torch), and while its
        # threads outnumber them it throttles their spin-wait: a borrowing step's worker then slept and woke after
        # each of the step's parallel regions (on_passing_thread in workers/step_threads.py says more).
        pin_this_process((*own, *borrowed))
    configure_process_env(engine.threads(), engine.kv_cache_space_gib)  # before torch is imported; it imports it
    import torch

    if borrowed:
        pin_this_process(own)
    if torch.cuda.is_available():  # a GPU engine's few host threads float
        if claim is not None:
            claim.release()
        pin_this_process(tuple(sorted(node)))
        logger.info("engine process %d drives a GPU: floats over cores %s", os.getpid(), sorted(node))
        return None, None
    if not borrowed:
        return claim, None
    by_context = "" if engine.borrow_min_context is None else f" or {engine.borrow_min_context} of context"
    logger.info("engine process %d borrows cores %s for steps of at least %d tokens%s", os.getpid(), list(borrowed),
                engine.borrow_min_tokens, by_context)
    return claim, StepThreads(own, borrowed, engine.borrow_min_tokens, engine.borrow_min_context)


class _Child(_PipeEnd):
    def __init__(self, conn: Any, with_controller: bool) -> None:
        self._conn = conn
        self._with_controller = with_controller
        self._send_lock = threading.Lock()  # the engine thread sends "fatal"
        self._tasks: dict[int, asyncio.Task] = {}
        self._reports: dict[int, asyncio.Future] = {}
        self._report_ids = itertools.count()
        self.core: ReplicaCore | None = None

    async def serve(self, config: ReplicaConfig, replica_id: str, node_id: str, preload: tuple[str, ...],
                    step_threads: StepThreads | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        try:
            self.core = ReplicaCore(config, replica_id=replica_id, node_id=node_id,
                                    controller=self._report if self._with_controller else None, on_fatal=self._fatal,
                                    step_threads=step_threads)
            for module in ("workers.prompts", *preload):  # after the engine: vLLM reads its settings at import
                importlib.import_module(module)
        except BaseException as exc:
            logger.exception("the engine failed to start")
            self._send(("start_failed", f"{type(exc).__name__}: {exc}"))
            return
        self.core.start()
        self._send(("ready",))
        self._start_reading()
        await self._stopped.wait()
        self.core.shutdown()


    def _closed(self) -> None:  # the replica is gone: so is its engine
        self._stopped.set()

    def _dispatch(self, message: tuple) -> None:
        tag = message[0]
        if tag == "generate":
            _, cid, kind, request, overrides, key = message
            self._tasks[cid] = self._loop.create_task(self._stream(cid, kind, request, overrides, key))
        elif tag == "cancel":
            task = self._tasks.pop(message[1], None)
            if task is not None:
                task.cancel()
        elif tag == "call":
            self._answer_call(message[1], message[2])
        elif tag == "answer":
            future = self._reports.get(message[1])
            if future is not None and not future.done():
                future.set_result(message[2])
        elif tag == "stop":
            self._stopped.set()

    async def _stream(self, cid: int, kind: str, request: Any, overrides: dict[str, Any] | None,
                      key: str | None) -> None:
        assert self.core is not None
        try:
            async for delta in self.core.generate(kind, request, overrides, key):
                self._send(("delta", cid, delta))
            self._send(("end", cid))
        except RequestError as exc:
            self._send(("raise", cid, exc))
        except Exception:
            logger.exception("request %s failed in the engine process", cid)
            self._send(("raise", cid, RequestFailed("the replica failed while serving this request")))
        finally:
            self._tasks.pop(cid, None)

    def _answer_call(self, cid: int, name: str) -> None:
        core = self.core
        assert core is not None
        try:
            value: Any
            if name == "info":
                value = core.info()
            elif name == "routing_stats":
                core.routing_polls += 1
                value = (core.load(), core.health_problem())
            elif name == "health_problem":
                value = core.health_problem()
            elif name == "inject_fault":
                core.runner.stop_with_error(RuntimeError("injected engine fault"))
                value = None
            else:
                raise ValueError(f"unknown call {name!r}")
        except Exception as exc:
            self._send(("result", cid, False, RequestFailed(f"{name} failed: {exc!r}")))
            return
        self._send(("result", cid, True, value))

    async def _report(self, report: TelemetryReport) -> ControllerAnswer | None:
        """The core's controller link: through the parent, which holds the Serve handle."""
        rid = next(self._report_ids)
        future = self._loop.create_future()
        self._reports[rid] = future
        try:
            self._send(("report", rid, report))
            return await future
        finally:  # ReplicaCore gives up after its controller timeout; a late answer is then dropped
            self._reports.pop(rid, None)

    def _fatal(self, exc: BaseException) -> None:
        """Engine thread: the loop stopped (its streams already have their error)."""
        try:
            self._send(("fatal", repr(exc)))
        except (OSError, ValueError):
            pass
