"""workers.aio.wait_for: asyncio.wait_for's contract without its lost cancellation (CPython gh-86296).

The replica's control loop awaited the controller through ``asyncio.wait_for`` every 50 ms; when ``asyncio.run``
cancelled it at exit in the loop iteration where a report's answer arrived, the cancellation was dropped, the
loop went on, and ``asyncio.run`` waited for it forever (a test-suite hang, 2026-12-03).
"""
from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path

import pytest

from workers.aio import wait_for


def _cancelled_as_the_call_ends(wait) -> str:
    """Cancel a caller of ``wait`` in the loop iteration where the call it waits on ends: what the caller sees."""

    async def scenario() -> str:
        call = asyncio.get_running_loop().create_future()

        async def caller():
            return await wait(call, 5.0)

        task = asyncio.ensure_future(caller())
        await asyncio.sleep(0)  # the caller is now suspended inside wait
        call.set_result("answer")  # its done callbacks are scheduled, not yet run
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return "cancelled"
        return "returned"

    return asyncio.run(scenario())


def test_a_caller_cancelled_as_the_call_ends_stays_cancelled():
    assert _cancelled_as_the_call_ends(wait_for) == "cancelled"


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="asyncio.wait_for keeps the cancellation from 3.12 on")
def test_asyncio_wait_for_drops_that_cancellation_before_3_12():
    """Why workers.aio exists: when this fails, the Python in use keeps the cancellation and the helper can go."""
    assert _cancelled_as_the_call_ends(asyncio.wait_for) == "returned"


def test_a_periodic_loop_through_it_ends_when_asyncio_run_exits():
    """The control loop's shape: a fast call awaited in a loop, cancelled by asyncio.run at exit, with the exit
    landing at each point of the loop's cycle (through asyncio.wait_for, two of them never return on 3.11).
    In a thread, so that a regression fails instead of hanging the suite."""

    async def answer() -> int:
        return 1

    async def periodic() -> None:
        while True:
            await asyncio.sleep(0)
            await wait_for(answer(), 1.0)

    async def main(steps: int) -> None:
        asyncio.get_running_loop().create_task(periodic())
        for _ in range(steps):
            await asyncio.sleep(0)

    def runs() -> None:
        for steps in range(4, 12):
            asyncio.run(main(steps))  # cancels periodic() and waits for it to end

    thread = threading.Thread(target=runs, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "asyncio.run never returned: the loop outlived its cancellation"


def test_result_exception_and_timeout_as_asyncio_wait_for():
    async def value():
        await asyncio.sleep(0)
        return 7

    async def failing():
        raise ValueError("boom")

    ended = []

    async def slow():
        try:
            await asyncio.sleep(10)
        finally:
            ended.append(True)

    async def main():
        assert await wait_for(value(), 1.0) == 7
        assert await wait_for(value(), None) == 7
        with pytest.raises(ValueError, match="boom"):
            await wait_for(failing(), 1.0)
        with pytest.raises(asyncio.TimeoutError):
            await wait_for(slow(), 0.01)
        assert ended == [True], "the timed-out call had not ended when the timeout was raised"

    asyncio.run(main())


def test_serving_code_awaits_with_deadlines_through_it():
    """asyncio.wait_for in serving code would bring the lost cancellation back."""
    root = Path(__file__).resolve().parents[1]
    offenders = [str(path.relative_to(root)) for package in ("workers", "deployments", "controller")
                 for path in (root / package).rglob("*.py")
                 if path.name != "aio.py" and "asyncio.wait_for(" in path.read_text()]
    assert not offenders, f"use workers.aio.wait_for in {offenders}"
