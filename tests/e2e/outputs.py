"""Reading a request's output stream straight from Redis, as its worker wrote it: what the tests compare
a client's text with, and how they tell a relay of finished work from work done again."""

from __future__ import annotations

import time

import redis

from loragate import contracts
from loragate.messages import OutputEvent

Entries = list[tuple[bytes, OutputEvent]]


def stored_output(redis_url: str, request_id: str) -> Entries:
    """(entry id, event) pairs of a request's output stream; [] before it has one. The stream's key may
    put a tenant's namespace before the client's id, so it is found by the id (unique to its test)."""
    r = redis.Redis.from_url(redis_url, socket_timeout=10, socket_connect_timeout=10)
    try:
        found = list(r.scan_iter(match=contracts.output("*", f"*{request_id}")))
        assert len(found) <= 1, found
        return [
            (entry, OutputEvent.from_json(fields[b"e"])) for key in found for entry, fields in r.xrange(key)
        ]
    finally:
        r.close()


def finished_output(redis_url: str, request_id: str, timeout: float = 60.0) -> Entries:
    """`stored_output` once its last event is in."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        entries = stored_output(redis_url, request_id)
        if entries and entries[-1][1].is_last:
            return entries
        time.sleep(0.1)
    raise AssertionError(f"request {request_id} did not finish within {timeout} s")
