"""Cancellations from the gateways: request ids published on `lg:cancel` when a client went away.

Every worker subscribes to the one channel and aborts only the ids it holds. The service subscribes
afresh, on a new connection, at every re-sync (`subscribe` closes the old one); between steps it takes
whatever arrived without waiting (`requested`). Pub/sub keeps nothing: a
cancel published while the worker was cut off from Redis never reaches it.
"""

from __future__ import annotations

import contextlib

import redis
from redis.client import PubSub

from loragate import contracts
from loragate.redis_retry import OUTAGE_ERRORS


class CancelFeed:
    def __init__(self, r: redis.Redis):
        self.redis = r
        self._pubsub: PubSub | None = None

    def subscribe(self) -> None:
        self.close()
        self._pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        self._pubsub.subscribe(contracts.CANCEL)

    def requested(self) -> list[str]:
        """The request ids cancelled since the last call (any worker's: the caller keeps its own)."""
        assert self._pubsub is not None  # subscribed by the service's re-sync
        ids = []
        while (msg := self._pubsub.get_message(timeout=0)) is not None:
            ids.append(msg["data"].decode() if isinstance(msg["data"], bytes) else str(msg["data"]))
        return ids

    def close(self) -> None:
        if self._pubsub is not None:
            with contextlib.suppress(*OUTAGE_ERRORS):  # a connection that is gone is closed enough
                self._pubsub.close()
