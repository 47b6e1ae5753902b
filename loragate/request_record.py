"""Where a request's queue entry is: the fields of its record `lg:req:{id}` (`contracts.request_record`), and
the scripts that move an entry and point the record at the new one in the same atomic step.

The gateway writes the record with the request's first queue entry (`gateway.request_store`); a retry
with the same `X-Request-Id` finds the request live while that entry exists. Whoever queues the request
again must therefore update the record with it: a gateway's reaper that re-routes a dead worker's entry
(`MOVE`), a worker that queues its running requests again after Redis lost them (`REQUEUE`). Shared here so
the worker need not import the gateway.
"""

from __future__ import annotations

from loragate.contracts import QUEUE_FIELD
from loragate.contracts import RECORD_ENTRY as ENTRY
from loragate.contracts import RECORD_QUEUE as QUEUE

# point(record, queue, entry): the record (if there is one: requests queued by hand have none) names it.
_POINT = f"""
local function point(record, queue, entry)
    if redis.call('EXISTS', record) == 1 then
        redis.call('HSET', record, '{QUEUE}', queue, '{ENTRY}', entry)
    end
end
"""

# KEYS: queue, record; ARGV: the message. Queues it and returns the new entry id. Runs inside the worker's
# re-queue transaction (`worker.ledger.restore_entries`).
REQUEUE = (
    _POINT
    + f"""
local entry = redis.call('XADD', KEYS[1], '*', '{QUEUE_FIELD}', ARGV[1])
point(KEYS[2], KEYS[1], entry)
return entry
"""
)

# KEYS: from queue, to queue, record; ARGV: the entry on `from`, the message for `to`, the consumer group.
# Moves the entry only if it is still on `from`, so running it twice (a retry after a lost reply, two
# gateways' reapers) queues one copy; returns the new entry id, or false if it was gone.
MOVE = (
    _POINT
    + f"""
if #redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1]) == 0 then
    return false
end
local entry = redis.call('XADD', KEYS[2], '*', '{QUEUE_FIELD}', ARGV[2])
point(KEYS[3], KEYS[2], entry)
redis.call('XACK', KEYS[1], ARGV[3], ARGV[1])
redis.call('XDEL', KEYS[1], ARGV[1])
return entry
"""
)
