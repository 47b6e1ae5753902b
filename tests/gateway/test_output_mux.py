"""The output relay on a real Redis: several handlers of one request id each get every event once, one
leaving does not take the other's channel, a channel reads on after an abort, and a subscription whose
wake-up fails or times out is not left behind."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.event_channel import EventChannel
from gateway.relay import OutputMux
from loragate import contracts
from loragate.messages import OutputEvent


def run(redis_url: str, body: Callable[[aioredis.Redis, OutputMux], Awaitable[None]]) -> None:
    async def main() -> None:
        r = aioredis.Redis.from_url(redis_url, socket_timeout=5)
        mux = OutputMux(redis_url, r, block_ms=200)
        await mux.start()
        try:
            await asyncio.wait_for(body(r, mux), 15)
        finally:
            await mux.stop()
            await r.aclose()

    asyncio.run(main())


async def put(r: aioredis.Redis, rid: str, text: str, finish: str | None = None) -> str:
    entry = await r.xadd(
        contracts.output("tiny", rid), {"e": OutputEvent(text=text, finish_reason=finish).to_json()}
    )
    return str(entry.decode())


async def texts(channel: EventChannel, n: int) -> list[str]:
    return [(await channel.get(5)).text for _ in range(n)]


def test_two_channels_of_one_request_each_get_every_event_once(redis_url: str) -> None:
    async def body(r: aioredis.Redis, mux: OutputMux) -> None:
        first = await mux.subscribe("tiny", "shared")
        await put(r, "shared", "a")
        assert await texts(first, 1) == ["a"]
        second = await mux.subscribe("tiny", "shared")  # a retry: relays from the start
        await put(r, "shared", "b")
        assert await texts(second, 2) == ["a", "b"]
        assert await texts(first, 1) == ["b"]
        mux.unsubscribe(
            "tiny", "shared", second
        )  # the retry's client left: the first handler keeps its channel
        await put(r, "shared", "c", "stop")
        assert await texts(first, 1) == ["c"]
        await asyncio.sleep(0.3)
        assert len(second) == 0 and len(first) == 0
        assert contracts.output("tiny", "shared") not in mux.subs  # nothing follows a last event

    run(redis_url, body)


def test_a_channel_reads_on_after_an_abort_is_deleted(redis_url: str) -> None:
    async def body(r: aioredis.Redis, mux: OutputMux) -> None:
        channel = await mux.subscribe("tiny", "cut")
        await put(r, "cut", "a")
        abort = await put(r, "cut", "", "abort")
        assert [(await channel.get(5)).finish_reason for _ in range(2)] == [None, "abort"]
        assert channel.last_id == abort
        await r.xdel(
            contracts.output("tiny", "cut"), abort
        )  # what `revive` does before queueing the request again
        await put(r, "cut", "b", "length")
        await mux.resume("tiny", "cut", channel)
        event = await channel.get(5)
        assert (event.text, event.finish_reason) == ("b", "length")

    run(redis_url, body)


@pytest.mark.parametrize("failure", ["refused", "silent"])
def test_a_subscription_whose_wake_up_fails_is_not_left_behind(redis_url: str, failure: str) -> None:
    with socket.socket() as listener:  # a "Redis" that accepts connections and never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        if failure == "refused":
            listener.close()

        async def body(r: aioredis.Redis, mux: OutputMux) -> None:
            await mux.subscribe("tiny", "busy")  # the reader now blocks on this stream
            while not mux._blocked:
                await asyncio.sleep(0.01)
            mux._control = aioredis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=1)
            try:
                with pytest.raises((RedisConnectionError, TimeoutError)):
                    async with asyncio.timeout(0.5):
                        await mux.subscribe("tiny", "late")
            finally:
                await mux._control.aclose()
            assert contracts.output("tiny", "late") not in mux.subs
            assert contracts.output("tiny", "busy") in mux.subs

        run(redis_url, body)
