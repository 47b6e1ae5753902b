"""The gateway's side of a Redis outage, against a redis-server of the test's own that it restarts: a
channel relays an event written again after an outage only once; right after Redis comes back the fleet
view still counts the workers it knew and the reaper takes no queue, until the grace has passed."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

import gateway.fleet
from gateway.event_channel import EventChannel
from gateway.fleet import Fleet
from gateway.reaper import Reaper
from gateway.relay import OutputMux
from loragate import contracts
from loragate.messages import OutputEvent, QueuedRequest, WorkerState
from loragate.redis_url import connect_async
from loragate.types import SamplingParams
from tests.redis_process import redis_process


def test_a_channel_relays_an_event_written_again_only_once() -> None:
    channel = EventChannel()
    sent = [OutputEvent(token_ids=(t,), text=str(t), completion_tokens=c) for c, t in enumerate((5, 6, 7), 1)]
    for e in [sent[0], sent[1], sent[0], sent[1], sent[2]]:  # a worker wrote 1 and 2 again
        channel.put(e)
    final = OutputEvent(finish_reason="abort", completion_tokens=3)  # no tokens: never a repeat
    channel.put(final)

    async def drain() -> list[OutputEvent]:
        return [await channel.get(0.1) for _ in range(len(channel))]

    assert asyncio.run(drain()) == [*sent, final]


def state(worker_id: str) -> str:
    return WorkerState(worker_id, "tiny", "/models/tiny", 2048).to_json()


def test_after_a_restart_known_workers_still_count_and_no_queue_is_reaped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(gateway.fleet, "RESYNC_GRACE_S", 1.5)
    msg = QueuedRequest("r1", "tiny", (1, 2, 3), SamplingParams(max_tokens=4))
    with redis_process(persistent=True) as server:

        async def main() -> None:
            r = connect_async(server.url)
            try:
                await r.set(contracts.worker_state("tiny", "w1"), state("w1"), ex=60)
                await r.set(contracts.worker_state("tiny", "w2"), state("w2"), ex=60)
                queue = contracts.queue("tiny", "w1")
                await r.xgroup_create(queue, contracts.WORKER_GROUP, id="0", mkstream=True)
                await r.xadd(queue, {"m": msg.to_json()})
                await r.xreadgroup(contracts.WORKER_GROUP, "w1", {queue: ">"})  # w1 runs it
                fleet = Fleet(r)
                reaper = Reaper(r, fleet, "reaper-test")
                await asyncio.sleep(2.6)  # past the young server's grace (its uptime counts whole seconds)
                await fleet.refresh()
                assert set(fleet.workers) == {"w1", "w2"} and not fleet.recovering
                await r.delete(
                    contracts.worker_state("tiny", "w1")
                )  # its heartbeat expired during the outage
                server.restart()  # from the AOF
                await r.delete(contracts.worker_state("tiny", "w1"))
                assert await reaper.sweep() == 0  # w1 may be about to re-announce itself
                assert fleet.recovering and set(fleet.workers) == {"w1", "w2"}
                assert sorted(w.state.worker_id for w in fleet.serving("tiny")) == ["w1", "w2"]
                assert await r.xlen(queue) == 1
                await asyncio.sleep(2.6)  # w1 did not come back within the grace: it is gone
                assert await reaper.sweep() == 1
                assert set(fleet.workers) == {"w2"} and not fleet.recovering
                assert await r.xlen(queue) == 0 and await r.xlen(contracts.queue("tiny", "w2")) == 1
            finally:
                await r.aclose()

        asyncio.run(main())


def test_a_fresh_redis_gives_workers_the_grace_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """A gateway that starts (or first connects) right after Redis restarted cannot have seen the outage."""
    with redis_process(persistent=False) as server:

        async def main() -> bool:
            r: aioredis.Redis = connect_async(server.url)
            try:
                fleet = Fleet(r)
                await fleet.refresh()
                return fleet.recovering
            finally:
                await r.aclose()

        assert asyncio.run(main())


def test_a_move_run_twice_queues_one_copy_and_points_the_record_at_it(redis_url: str) -> None:
    """The reaper's client retries a command whose reply was lost, and two gateways' reapers may take the
    same entry: a move run twice must leave one copy, and the request's record must name it."""
    msg = QueuedRequest("moved-1", "tiny", (1, 2, 3), SamplingParams(max_tokens=4))

    async def main() -> None:
        r = connect_async(redis_url)
        try:
            await r.set(contracts.worker_state("tiny", "w2"), state("w2"), ex=60)
            dead = contracts.queue("tiny", "w1")
            await r.xgroup_create(dead, contracts.WORKER_GROUP, id="0", mkstream=True)
            entry = await r.xadd(dead, {"m": msg.to_json()})
            await r.hset(
                contracts.request_record("tiny", "moved-1"),
                mapping={"fp": "x", "queue": dead, "entry": entry},
            )
            await r.xreadgroup(contracts.WORKER_GROUP, "w1", {dead: ">"})  # w1 read it, then died
            fleet = Fleet(r)
            await fleet.refresh()
            reaper = Reaper(r, fleet, "reaper-test")
            assert await reaper._reroute(dead, entry, msg)
            assert not await reaper._reroute(dead, entry, msg)  # again, as a retry would
            copies = await r.xrange(contracts.queue("tiny", "w2"))
            assert len(copies) == 1, f"{len(copies)} copies queued"
            record = await r.hgetall(contracts.request_record("tiny", "moved-1"))
            assert (
                record[b"queue"].decode() == contracts.queue("tiny", "w2")
                and record[b"entry"] == copies[0][0]
            )
            assert await r.xlen(dead) == 0
        finally:
            await r.aclose()

    asyncio.run(main())


def test_a_stream_subscribed_while_the_relay_reconnects_is_read_at_once() -> None:
    """A subscribe while the relay re-reads its connection's id after a restart must neither wake a read
    by the old server's client id (another client's, perhaps) nor wait out the next blocking read."""
    with redis_process(persistent=False) as server:

        async def main() -> float:
            control = connect_async(server.url)
            mux = OutputMux(server.url, control, block_ms=5000)
            reconnecting, resume = asyncio.Event(), asyncio.Event()
            reconnected = mux._reconnected

            async def slow_reconnect() -> None:
                if mux._run_id is not None:  # after the restart: hold it here while a stream subscribes
                    reconnecting.set()
                    await resume.wait()
                await reconnected()

            mux._reconnected = slow_reconnect  # type: ignore[method-assign]
            try:
                await mux.start()
                await mux.subscribe("tiny", "first")
                while not mux._blocked:
                    await asyncio.sleep(0.01)
                await asyncio.to_thread(server.restart)
                await asyncio.wait_for(reconnecting.wait(), 10)
                channel = await mux.subscribe("tiny", "second")
                resume.set()
                await asyncio.sleep(0.2)  # the relay is in its next blocking read
                loop = asyncio.get_running_loop()
                sent = loop.time()
                event = OutputEvent(token_ids=(5,), text="5", completion_tokens=1)
                await control.xadd(contracts.output("tiny", "second"), {"e": event.to_json()})
                got = await channel.get(10.0)
                assert got == event
                return loop.time() - sent
            finally:
                await mux.stop()
                await control.aclose()

        took = asyncio.run(main())
        assert took < 1.0, f"the event took {took:.1f} s (the relay's read did not include its stream)"
