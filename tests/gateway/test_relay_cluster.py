"""The output relay on a real 3-master Redis Cluster (`tests.redis_cluster`): each model's streams are read
on the node owning its slot, two models on two nodes relay at once, and when a model's slot moves to
another node (resharding) the relay follows it with its open channels, which go on from where they were."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import redis.asyncio as aioredis
from redis.cluster import key_slot

from gateway.event_channel import EventChannel
from gateway.relay_cluster import ClusterOutputMux
from loragate import contracts
from loragate.messages import OutputEvent
from loragate.redis_url import connect_async
from tests.redis_cluster import RedisCluster3, redis_cluster


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster3]:
    with redis_cluster() as c:
        yield c


def _on_other_nodes(cluster: RedisCluster3, n: int) -> list[str]:
    """`n` model names whose slots are owned by `n` different masters."""
    names: dict[int, str] = {}
    for i in range(1000):
        names.setdefault(cluster.node_of(contracts.model_queue(f"m{i}")), f"m{i}")
        if len(names) == n:
            return list(names.values())
    raise AssertionError("names do not spread over the masters")


async def _put(r: aioredis.Redis, model: str, rid: str, text: str, finish: str | None = None) -> None:
    event = OutputEvent(text=text, finish_reason=finish).to_json()
    await r.xadd(contracts.output(model, rid), {contracts.OUTPUT_FIELD: event})


async def _texts(channel: EventChannel, n: int) -> list[str]:
    return [(await channel.get(10)).text for _ in range(n)]


def _run(cluster: RedisCluster3, body: object) -> None:
    async def main() -> None:
        r = connect_async(cluster.url)
        mux = ClusterOutputMux(cluster.url, r, block_ms=500, check_s=0.2)
        await mux.start()
        try:
            await asyncio.wait_for(body(r, mux), 30)  # type: ignore[operator]
        finally:
            await mux.stop()
            await r.aclose()

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_two_models_on_two_nodes_relay_at_once(cluster: RedisCluster3) -> None:
    a, b = _on_other_nodes(cluster, 2)

    async def body(r: aioredis.Redis, mux: ClusterOutputMux) -> None:
        ca = await mux.subscribe(a, "r1")
        cb = await mux.subscribe(b, "r1")  # the same client id under two models: two streams
        assert {m for m in mux.muxes} == {a, b}
        assert mux.muxes[a].url != mux.muxes[b].url  # each read on its own node
        await _put(r, a, "r1", "a1")
        await _put(r, b, "r1", "b1")
        assert await _texts(ca, 1) == ["a1"] and await _texts(cb, 1) == ["b1"]
        await _put(r, a, "r1", "a2", "stop")
        assert await _texts(ca, 1) == ["a2"]
        await asyncio.sleep(0.3)
        assert contracts.output(a, "r1") not in mux.subs  # nothing follows a last event
        assert contracts.output(b, "r1") in mux.subs
        mux.unsubscribe(b, "r1", cb)
        assert not mux.subs

    _run(cluster, body)


@pytest.mark.timeout(120)
def test_a_models_relay_follows_its_slot_to_another_node(cluster: RedisCluster3) -> None:
    (model,) = _on_other_nodes(cluster, 1)
    slot = key_slot(contracts.model_queue(model).encode())
    home = cluster.node_of(contracts.model_queue(model))
    target = (home + 1) % len(cluster.ports)

    async def body(r: aioredis.Redis, mux: ClusterOutputMux) -> None:
        channel = await mux.subscribe(model, "moving")
        await _put(r, model, "moving", "before")
        assert await _texts(channel, 1) == ["before"]
        first_url = mux.muxes[model].url
        await asyncio.to_thread(cluster.move_slot, slot, target)
        assert cluster.node_of(contracts.model_queue(model)) == target
        await _put(r, model, "moving", "after")  # written on the new owner (the client follows MOVED)
        assert await _texts(channel, 1) == ["after"]  # relayed from there: no event lost, none twice
        assert mux.muxes[model].url != first_url
        await _put(r, model, "moving", "end", "stop")
        assert await _texts(channel, 1) == ["end"]
        late = await mux.subscribe(model, "late")  # a new subscription reads on the new owner at once
        await _put(r, model, "late", "x", "stop")
        assert await _texts(late, 1) == ["x"]

    _run(cluster, body)
