"""The per-request event channel the output relay fills and a request handler drains."""

from __future__ import annotations

import asyncio

import pytest

from gateway.event_channel import ClientGone, EventChannel
from loragate.messages import OutputEvent


def event(text: str, finish: str | None = None) -> OutputEvent:
    return OutputEvent(text=text, finish_reason=finish)


def test_events_come_out_in_order_and_a_waiting_get_wakes_on_put() -> None:
    async def main() -> list[str]:
        channel = EventChannel()
        channel.put(event("a"))
        channel.put(event("b"))
        got = [(await channel.get(1.0)).text, (await channel.get(1.0)).text]
        waiting = asyncio.ensure_future(channel.get(5.0))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        channel.put(event("c", "stop"))
        got.append((await asyncio.wait_for(waiting, 1.0)).text)
        assert len(channel) == 0
        return got

    assert asyncio.run(main()) == ["a", "b", "c"]


def test_a_get_times_out_and_the_channel_still_works_after() -> None:
    async def main() -> str:
        channel = EventChannel()
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(TimeoutError):
            await channel.get(0.05)
        assert loop.time() - start >= 0.04
        channel.put(event("late"))
        return (await channel.get(0.05)).text

    assert asyncio.run(main()) == "late"


def test_client_gone_wakes_a_waiting_get_and_fails_later_ones() -> None:
    async def main() -> None:
        channel = EventChannel()
        waiting = asyncio.ensure_future(channel.get(5.0))
        await asyncio.sleep(0.01)
        channel.client_gone()
        with pytest.raises(ClientGone):
            await asyncio.wait_for(waiting, 1.0)
        with pytest.raises(ClientGone):
            await channel.get(1.0)

    asyncio.run(main())


def test_events_that_arrived_before_the_client_left_are_handed_out_first() -> None:
    async def main() -> list[str]:
        channel = EventChannel()
        channel.put(event("a"))
        channel.put(event("b", "stop"))  # the request finished as its client left
        channel.client_gone()
        got = [(await channel.get(1.0)).text, (await channel.get(1.0)).text]
        with pytest.raises(ClientGone):
            await channel.get(1.0)
        return got

    assert asyncio.run(main()) == ["a", "b"]
