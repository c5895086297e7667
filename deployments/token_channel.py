"""A direct channel for a stream's tokens, from the worker replica that generates them to the ingress replica
that asked for them.

Why: through Serve's deployment handle every token is an item of its own, which Ray streams from the
worker replica's process to the ingress's, and each process handles it on a few threads of its own. On the
core the engine leaves (a 2-core machine's other one), a step's tokens then queue behind one another in the
worker, the ingress and Serve's proxy, and reach their clients bunched (docs/results/README.md: the
serve-profile-processes rows measure what each process spends per token, with this channel and without).
Here each ingress replica listens on one TCP port of its node, each worker replica keeps one connection to
each ingress replica it serves, and what the worker has for one ingress when its event loop next runs goes
in one write: a step's tokens for all of that ingress's streams at once.

The Serve call stays what it was for everything but the tokens after the first: Serve's router picks the
replica and counts the call in flight, the first delta (or the failure before it) comes back through it, a
client that leaves cancels it (which aborts the request in the engine), and a replica that dies fails it.
After the first delta the worker yields ``ON_CHANNEL`` and sends the rest over the channel, then ``END``.
Where it cannot connect (another node that this one cannot reach, say) it keeps yielding through Serve, as
without the channel, and tries that address again only after ``RETRY_UNREACHABLE_S``.

Frames: a 4-byte little-endian length, then a pickle of ``[(stream id, item), ...]``. The first frame of a
connection is the ingress's secret, which the worker learned from the call (over Ray); the ingress reads
nothing further from a connection that does not open with it.
"""
from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import pickle
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from workers.aio import wait_for
from workers.errors import ReplicaUnavailable

logger = logging.getLogger(__name__)

ON_CHANNEL = "entropic.token_channel.on"  # yielded through Serve: the rest of this stream comes over the channel
END = "entropic.token_channel.end"  # sent over the channel: the stream ended
CONNECT_TIMEOUT_S = 2.0
RETRY_UNREACHABLE_S = 60.0
# After the Serve call ends, how long the channel may take to bring the stream's END (sent before the call
# returns, so it is normally there within a millisecond)
END_GRACE_S = 10.0
_MAX_FRAME = 64 * 2**20


@dataclass(frozen=True)
class Ticket:
    """Where the worker sends one stream's tokens: the ingress's address and secret, and the stream's id."""
    host: str
    port: int
    secret: bytes
    stream_id: int


def _frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(4, "little") + payload


async def _read_frame(reader: asyncio.StreamReader, limit: int = _MAX_FRAME) -> bytes:
    size = int.from_bytes(await reader.readexactly(4), "little")
    if size > limit:
        raise ConnectionError(f"a frame of {size} bytes")
    return await reader.readexactly(size)


class TokenSink:
    """Ingress side: the listening socket, and one queue per stream that waits for tokens."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.secret = secrets.token_bytes(16)
        self._port: int | None = None
        self._server: asyncio.AbstractServer | None = None
        self._starting = asyncio.Lock()
        self._ids = itertools.count()
        self._queues: dict[int, asyncio.Queue] = {}

    async def ticket(self) -> Ticket:
        """A stream id with its queue, to pass to the worker with the call (``release`` it if the call fails)."""
        if self._port is None:
            async with self._starting:
                if self._port is None:
                    self._server = await asyncio.start_server(self._serve, self.host, 0)
                    self._port = self._server.sockets[0].getsockname()[1]
        stream_id = next(self._ids)
        self._queues[stream_id] = asyncio.Queue()
        assert self._port is not None
        return Ticket(self.host, self._port, self.secret, stream_id)

    def release(self, stream_id: int) -> None:
        self._queues.pop(stream_id, None)

    def stream(self, serve_stream: Any, ticket: Ticket) -> ChannelStream:
        return ChannelStream(serve_stream, self, ticket.stream_id, self._queues[ticket.stream_id])

    def close(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen: set[int] = set()
        try:
            if not hmac.compare_digest(await _read_frame(reader, limit=len(self.secret)), self.secret):
                logger.warning("a token channel connection without this ingress's secret was closed")
                return
            while True:
                for stream_id, item in pickle.loads(await _read_frame(reader)):
                    queue = self._queues.get(stream_id)
                    if queue is not None:  # None: its client left, or it failed over to another replica
                        queue.put_nowait(item)
                        if (isinstance(item, str) and item == END) or isinstance(item, Exception):
                            seen.discard(stream_id)  # its last item
                        else:
                            seen.add(stream_id)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):  # closed, or a first frame too long
            pass
        except Exception:  # a frame that does not unpickle: the streams on it fail below, the ingress goes on
            logger.exception("a token channel frame could not be read; closing that connection")
        finally:
            writer.close()
            for stream_id in seen:  # streams still open on this connection end with an error, not a hang
                queue = self._queues.get(stream_id)
                if queue is not None:
                    queue.put_nowait(_Raised(ReplicaUnavailable("the replica's token channel closed mid-stream")))


class ChannelStream:
    """One stream's items after its first, as the Serve call's stream gives them: from the channel, or from
    the Serve call where the worker could not connect. ``cancel`` cancels the Serve call."""

    def __init__(self, serve_stream: Any, sink: TokenSink, stream_id: int, queue: asyncio.Queue) -> None:
        self._serve_stream = serve_stream
        self._sink = sink
        self._id = stream_id
        self._queue = queue
        self._watch: asyncio.Task | None = None

    def cancel(self) -> None:
        self._sink.release(self._id)
        if self._watch is not None:
            self._watch.cancel()
        self._serve_stream.cancel()

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._items()

    async def _items(self) -> AsyncIterator[Any]:
        self._watch = asyncio.ensure_future(self._watch_serve_call())
        try:
            while True:
                item = await self._queue.get()
                if isinstance(item, str) and item == END:
                    return
                if isinstance(item, _Raised):
                    raise item.exc
                yield item  # a delta, or a RequestError the worker yields (the caller raises it)
        finally:
            self._sink.release(self._id)
            self._watch.cancel()

    async def _watch_serve_call(self) -> None:
        """What the Serve call still brings: ``ON_CHANNEL``, the items of a worker that could not connect, its
        end, or its failure (the replica died)."""
        on_channel = False
        try:
            async for item in self._serve_stream:
                if isinstance(item, str) and item == ON_CHANNEL:
                    on_channel = True
                else:
                    self._queue.put_nowait(item)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._queue.put_nowait(_Raised(exc))
            return
        if not on_channel:
            self._queue.put_nowait(END)
            return
        await asyncio.sleep(END_GRACE_S)  # normally cancelled before: END came and the consumer stopped
        self._queue.put_nowait(_Raised(ReplicaUnavailable("the replica's token channel did not end the stream")))


class _Raised:
    """A failure of the Serve call or of the channel, as opposed to an item the worker yielded."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc


class _Connection:
    def __init__(self) -> None:
        self.writer: asyncio.StreamWriter | None = None
        self.pending: list[tuple[int, Any]] = []
        self.scheduled = False

    @property
    def closed(self) -> bool:
        return self.writer is None or self.writer.is_closing()

    def send(self, stream_id: int, item: Any) -> None:
        """Queue ``item``; everything queued goes in one write when the event loop next runs."""
        if self.closed:
            raise ConnectionError("the token channel to the ingress is closed")
        self.pending.append((stream_id, item))
        if not self.scheduled:
            self.scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self.scheduled = False
        items, self.pending = self.pending, []
        if items and not self.closed:
            assert self.writer is not None
            self.writer.write(_frame(pickle.dumps(items)))


class TokenLink:
    """Worker side: one connection per ingress replica, opened on its first stream."""

    def __init__(self) -> None:
        # by address and secret: an ingress that took over a gone one's port gets a connection of its own
        self._connections: dict[tuple[str, int, bytes], asyncio.Future] = {}
        self._unreachable: dict[tuple[str, int, bytes], float] = {}

    async def connect(self, ticket: Ticket) -> _Connection | None:
        """The connection to the ticket's ingress, or None where it cannot be reached (then the stream goes
        through Serve)."""
        key = (ticket.host, ticket.port, ticket.secret)
        if time.monotonic() < self._unreachable.get(key, 0.0):
            return None
        opening = self._connections.get(key)
        if opening is None or (opening.done() and (opening.exception() is not None or opening.result().closed)):
            opening = self._connections[key] = asyncio.ensure_future(self._open(ticket))
        try:
            connection = await asyncio.shield(opening)
        except (OSError, asyncio.TimeoutError) as exc:
            logger.warning("no token channel to the ingress at %s:%d (%r): its streams go through Serve for %.0f s",
                           ticket.host, ticket.port, exc, RETRY_UNREACHABLE_S)
            self._unreachable[key] = time.monotonic() + RETRY_UNREACHABLE_S
            return None
        return None if connection.closed else connection

    @staticmethod
    async def _open(ticket: Ticket) -> _Connection:
        _, writer = await wait_for(asyncio.open_connection(ticket.host, ticket.port), CONNECT_TIMEOUT_S)
        writer.write(_frame(ticket.secret))
        connection = _Connection()
        connection.writer = writer
        return connection
