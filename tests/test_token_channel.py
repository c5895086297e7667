"""deployments/token_channel.py over real sockets on this machine: both ends as the worker and the ingress run
them. The Serve call each stream rides on is a stand-in here (``Call``: the items Serve would bring, and its
cancel), so each case can end it as a replica would; the served tests (tests/test_http_api.py and others)
run the whole path through a real Serve app, where the channel is on by default."""
import asyncio
import pickle

import pytest

from deployments.token_channel import END, ON_CHANNEL, TokenLink, TokenSink, _frame
from workers.errors import InvalidRequest, ReplicaUnavailable


class Call:
    """Stand-in for Serve's streaming call: yields what the worker yields through Serve after the first delta."""

    def __init__(self, items=(), error=None, hold=None):
        self.items, self.error, self.hold, self.cancelled = list(items), error, hold, False

    def cancel(self):
        self.cancelled = True

    def __aiter__(self):
        return self._run()

    async def _run(self):
        for item in self.items:
            yield item
        if self.hold is not None:
            await self.hold.wait()
        if self.error is not None:
            raise self.error


async def _collect(stream):
    return [item async for item in stream]


def test_a_steps_tokens_for_several_streams_go_in_one_write_and_each_stream_ends_at_its_end():
    async def scenario():
        sink, link = TokenSink("127.0.0.1"), TokenLink()
        tickets = [await sink.ticket() for _ in range(3)]
        streams = [sink.stream(Call([ON_CHANNEL]), t) for t in tickets]
        readers = [asyncio.ensure_future(_collect(s)) for s in streams]
        channel = await link.connect(tickets[0])
        assert channel is not None and await link.connect(tickets[1]) is channel  # one connection per ingress
        for step in range(4):
            for t in tickets:
                channel.send(t.stream_id, f"token {step} of {t.stream_id}")
            assert len(channel.pending) == 3  # nothing written until the loop runs again: one write per step
            await asyncio.sleep(0)
            assert channel.pending == []
        for t in tickets:
            channel.send(t.stream_id, END)
        got = await asyncio.wait_for(asyncio.gather(*readers), 5)
        sink.close()
        return tickets, got

    tickets, got = asyncio.run(scenario())
    for t, items in zip(tickets, got):
        assert items == [f"token {step} of {t.stream_id}" for step in range(4)]


def test_a_worker_that_cannot_reach_the_ingress_streams_through_serve_and_does_not_retry_at_once():
    async def scenario():
        sink, link = TokenSink("127.0.0.1"), TokenLink()
        ticket = await sink.ticket()
        sink.close()  # nothing listens there any more
        await asyncio.sleep(0.05)
        assert await link.connect(ticket) is None
        started = asyncio.get_running_loop().time()
        assert await link.connect(ticket) is None  # remembered: no second wait on an unreachable address
        assert asyncio.get_running_loop().time() - started < 0.05
        # the worker keeps yielding through the Serve call, which ends the stream when it ends
        return await asyncio.wait_for(_collect(sink.stream(Call(["b", "c"]), ticket)), 5)

    assert asyncio.run(scenario()) == ["b", "c"]


def test_a_connection_without_the_secret_is_closed_before_anything_is_unpickled():
    class Boom:
        def __reduce__(self):
            return (pytest.fail, ("unpickled a frame from a connection without the secret",))

    async def scenario():
        sink = TokenSink("127.0.0.1")
        ticket = await sink.ticket()
        stream = sink.stream(Call([ON_CHANNEL], hold=asyncio.Event()), ticket)
        reader = asyncio.ensure_future(_collect(stream))
        await asyncio.sleep(0)
        r, w = await asyncio.open_connection(ticket.host, ticket.port)
        w.write(_frame(b"not the secret") + _frame(pickle.dumps([(ticket.stream_id, Boom())])))
        assert await asyncio.wait_for(r.read(), 5) == b""  # the ingress closed it
        r, w = await asyncio.open_connection(ticket.host, ticket.port)
        w.write((64 * 2**20).to_bytes(4, "little"))  # a "secret" the ingress would have to buffer 64 MiB of
        assert await asyncio.wait_for(r.read(), 5) == b""
        assert not reader.done()
        stream.cancel()
        reader.cancel()
        sink.close()

    asyncio.run(scenario())


def test_a_channel_that_closes_mid_stream_fails_its_streams_in_band_instead_of_hanging():
    async def scenario():
        sink, link = TokenSink("127.0.0.1"), TokenLink()
        ticket, idle = await sink.ticket(), await sink.ticket()
        stream = sink.stream(Call([ON_CHANNEL], hold=asyncio.Event()), ticket)
        reader = asyncio.ensure_future(_collect(stream))
        channel = await link.connect(ticket)
        channel.send(ticket.stream_id, "a")
        await asyncio.sleep(0.05)
        channel.writer.close()  # the worker's end goes away (its process died)
        with pytest.raises(ReplicaUnavailable, match="closed mid-stream"):
            await asyncio.wait_for(reader, 5)
        with pytest.raises(ConnectionError):
            channel.send(ticket.stream_id, "b")  # the worker's request ends there, and the engine aborts it
        assert idle.stream_id in sink._queues  # a stream that sent nothing on it waits for its own call
        sink.close()

    asyncio.run(scenario())


def test_what_the_serve_call_brings_still_counts_failures_and_an_end_without_the_channels_end():
    async def scenario():
        sink = TokenSink("127.0.0.1")
        # the replica died: Serve's call raises, the stream raises it
        failed = sink.stream(Call([ON_CHANNEL], error=RuntimeError("actor died")), await sink.ticket())
        with pytest.raises(RuntimeError, match="actor died"):
            await asyncio.wait_for(_collect(failed), 5)
        # an expected failure yielded by the worker is an item, raised by the caller (deployments.openai_api)
        yielded = await asyncio.wait_for(_collect(sink.stream(Call([InvalidRequest("bad", "x")]), await sink.ticket())), 5)
        assert isinstance(yielded[0], InvalidRequest)
        # on the channel, the call ended and END never came: an in-band error after the grace period
        import deployments.token_channel as tc

        grace, tc.END_GRACE_S = tc.END_GRACE_S, 0.05
        try:
            with pytest.raises(ReplicaUnavailable, match="did not end the stream"):
                await asyncio.wait_for(_collect(sink.stream(Call([ON_CHANNEL]), await sink.ticket())), 5)
        finally:
            tc.END_GRACE_S = grace
        # cancel: the call is cancelled and the stream forgotten, so late tokens for it are dropped
        call, ticket = Call([ON_CHANNEL], hold=asyncio.Event()), await sink.ticket()
        stream = sink.stream(call, ticket)
        stream.cancel()
        assert call.cancelled and ticket.stream_id not in sink._queues
        sink.close()

    asyncio.run(scenario())
