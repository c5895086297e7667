"""``wait_for`` that never loses its caller's cancellation.

Before Python 3.12, ``asyncio.wait_for`` returns the awaited result when its caller is cancelled in the same
loop iteration as the awaited call ends (CPython gh-86296): the cancellation is dropped. A loop that awaits a
fast call through it every period, as the replica's control loop does, then survives ``cancel()``, and
``asyncio.run`` waits for it forever when it cancels the tasks left at exit.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def wait_for(awaitable: Awaitable[T], timeout: float | None) -> T:
    """``asyncio.wait_for``'s contract (the result, the awaited call's exception, or ``asyncio.TimeoutError``
    once the call, cancelled after ``timeout`` seconds, has ended), except that a cancelled caller always
    sees ``CancelledError``; the call is cancelled with it."""
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait((task,), timeout=timeout)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.cancel()
        await asyncio.wait((task,))  # as asyncio.wait_for: the call has ended when the timeout is raised
        if task.cancelled():
            raise asyncio.TimeoutError
    return task.result()
