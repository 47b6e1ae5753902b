"""The output relay on Redis Cluster: one `OutputMux` per base model.

An `XREAD` may only name keys of one slot, and a blocked read is woken (`CLIENT UNBLOCK`) only by a
command to its own node. Every output stream of a model carries the model's hash tag, so the streams of
one model are one slot: a model's mux reads them on its own connection to the node that owns that slot,
and wakes that reader through a small client of the same node (a caller's pipeline, routed by key over the
cluster, cannot carry the wake-up). A mux starts with the model's first request through this gateway.

If the slot moves (a failover, or resharding), the mux's reads fail (`MOVED`, or its node is gone): a
watch re-reads the slot map every `check_s` and moves that model's relay, with its channels and their
positions, to the slot's new owner. A gateway on a cluster holds one blocking connection per model.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from gateway.event_channel import EventChannel
from gateway.relay import OutputMux
from loragate import contracts
from loragate.redis_url import connect_async, node_url

log = logging.getLogger("loragate.gateway")


class ClusterOutputMux:
    """`OutputMux`'s interface over a cluster: each call goes to the mux of the request's model."""

    def __init__(
        self,
        redis_url: str,
        cluster: aioredis.Redis,
        block_ms: int = 1000,
        batch: int = 256,
        check_s: float = 1.0,
    ):
        self.url, self.cluster = redis_url, cluster
        self.block_ms, self.batch, self.check_s = block_ms, batch, check_s
        self.muxes: dict[str, _Slot] = {}  # model -> its mux
        self._lost = 0  # of the muxes closed since
        self._watch: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """A model's mux starts with its first subscription; this starts the watch for moved slots."""
        self._watch = asyncio.create_task(self._watch_slots())

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        for model in list(self.muxes):
            await self._close(self.muxes.pop(model))

    @property
    def lost(self) -> int:
        return self._lost + sum(slot.mux.lost for slot in self.muxes.values())

    @property
    def subs(self) -> dict[str, list[EventChannel]]:
        """Every open output stream (the relays of all models)."""
        return {key: chans for slot in self.muxes.values() for key, chans in slot.mux.subs.items()}

    async def _owner(self, model: str, refresh: bool) -> str:
        """The URL of the node that owns `model`'s slot (after re-reading the slot map if `refresh`)."""
        cluster = self.cluster  # a redis.asyncio.RedisCluster behind the common client type
        if refresh:
            await cluster.nodes_manager.initialize()
        else:
            await cluster.initialize()
        node = cluster.get_node_from_key(contracts.model_queue(model))
        return node_url(self.url, node.host, node.port)

    async def _mux(self, model: str) -> OutputMux:
        slot = self.muxes.get(model)
        if slot is None:
            url = await self._owner(model, refresh=False)
            slot = self.muxes.get(model)  # another subscription may have made it meanwhile
            if slot is None:
                slot = self.muxes[model] = self._open(model, url)
                await slot.mux.start()
        return slot.mux

    def _open(self, model: str, url: str) -> _Slot:
        control = connect_async(url, max_connections=8)
        mux = OutputMux(
            url,
            control,
            self.block_ms,
            self.batch,
            queue_patterns=contracts.queue_patterns(model),
            unblock_in_pipe=False,
        )
        log.info("relaying the outputs of %s from %s", model, url.rpartition("@")[2])
        return _Slot(url, mux, control)

    async def _close(self, slot: _Slot) -> None:
        self._lost += slot.mux.lost
        await slot.mux.stop()
        await slot.control.aclose()

    async def _watch_slots(self) -> None:
        """Move the relay of a model whose reads fail to its slot's current owner, with its channels."""
        while True:
            await asyncio.sleep(self.check_s)
            for model, slot in list(self.muxes.items()):
                if not slot.mux.failing:
                    continue
                try:
                    url = await self._owner(model, refresh=True)
                except Exception as e:  # the cluster is not answering: look again later
                    log.debug("cluster slot map unavailable: %r", e)
                    continue
                if url == slot.url or self.muxes.get(model) is not slot:
                    continue
                moved = self._open(model, url)
                moved.mux.subs.update(slot.mux.subs)  # each channel goes on from its own position
                self.muxes[model] = moved
                await moved.mux.start()
                await self._close(slot)

    async def subscribe(
        self, model: str, request_id: str, from_id: str = "0", pipe: Pipeline | None = None
    ) -> EventChannel:
        mux = await self._mux(model)
        return await mux.subscribe(model, request_id, from_id, pipe)

    async def resume(
        self, model: str, request_id: str, channel: EventChannel, pipe: Pipeline | None = None
    ) -> None:
        mux = await self._mux(model)
        await mux.resume(model, request_id, channel, pipe)

    def unsubscribe(self, model: str, request_id: str, channel: EventChannel) -> None:
        slot = self.muxes.get(model)
        if slot is not None:
            slot.mux.unsubscribe(model, request_id, channel)


@dataclass
class _Slot:
    url: str  # the node's
    mux: OutputMux
    control: aioredis.Redis
