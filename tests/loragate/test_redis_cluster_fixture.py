"""The test helper `tests.redis_cluster` starts a real 3-master Redis Cluster: every master owns slots, hash
tags place keys on chosen nodes, same-slot multi-key commands work through `redis.cluster.RedisCluster`,
cross-slot ones are refused, and `stop` leaves no node process behind. And loragate's blocking cluster client
(`loragate.redis_url.connect_sync`) closes its connections to every node when it is closed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
import redis
from redis.exceptions import ClusterCrossSlotError, CrossSlotTransactionError, RedisClusterException

from loragate.redis_url import connect_sync
from tests.redis_cluster import RedisCluster3, redis_cluster


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster3]:
    with redis_cluster() as c:
        yield c


def _tags_on_every_node(cluster: RedisCluster3) -> list[str]:
    """One hash tag per master, in node order: `{t0}`, `{t7}`, … whichever land there first."""
    tags: dict[int, str] = {}
    for j in range(1000):
        tags.setdefault(cluster.node_of(f"{{t{j}}}"), f"{{t{j}}}")
        if len(tags) == len(cluster.node_urls):
            return [tags[i] for i in range(len(tags))]
    raise AssertionError(f"hash tags reached only nodes {sorted(tags)}")


@pytest.mark.timeout(60)
def test_three_masters_are_ok_and_split_all_16384_slots(cluster: RedisCluster3) -> None:
    assert cluster.url == cluster.node_urls[0].replace("redis://", "redis+cluster://")
    assert len(set(cluster.node_urls)) == 3
    owned: dict[str, int] = {}
    for url in cluster.node_urls:
        with redis.Redis.from_url(url, socket_timeout=5) as node:
            info = node.cluster("INFO")
            state = (info["cluster_state"], info["cluster_size"], info["cluster_known_nodes"])
            assert state == ("ok", "3", "3")
            for start, end, owner, *_ in node.execute_command("CLUSTER", "SLOTS"):
                owner_url = f"redis://127.0.0.1:{int(owner[1])}"
                owned[owner_url] = owned.get(owner_url, 0) + end - start + 1
    # Each node reported the same map, so every slot was counted once per node.
    assert sorted(owned) == sorted(cluster.node_urls)
    assert all(n > 0 for n in owned.values())
    assert sum(owned.values()) == 16384 * 3


@pytest.mark.timeout(60)
def test_a_closed_sync_cluster_client_leaves_no_connection_on_any_node(cluster: RedisCluster3) -> None:
    observers = [redis.Redis.from_url(url, socket_timeout=5) for url in cluster.node_urls]
    try:

        def clients() -> list[int]:
            return [len(o.client_list()) for o in observers]

        before = clients()
        r = connect_sync(cluster.url)
        for tag in _tags_on_every_node(cluster):
            r.set(f"{tag}close-{os.getpid()}", 1)  # a connection to every master
        opened = clients()
        assert all(o > b for o, b in zip(opened, before, strict=True)), (before, opened)
        r.close()
        # a server sees a closed socket on its next event-loop turn: poll briefly (a leak never settles)
        deadline = time.monotonic() + 5
        while clients() != before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert clients() == before  # redis-py's own close left every node's socket open
    finally:
        for o in observers:
            o.close()


@pytest.mark.timeout(60)
def test_same_tag_keys_go_together_and_cross_slot_commands_are_refused(cluster: RedisCluster3) -> None:
    tags = _tags_on_every_node(cluster)
    client = cluster.client()
    try:
        for i, tag in enumerate(tags):
            client.set(f"{tag}:k", str(i))
            # The key really lives on node i: that node serves it without a redirect.
            with redis.Redis.from_url(cluster.node_urls[i], socket_timeout=5) as node:
                assert node.get(f"{tag}:k") == str(i).encode()

        a, b = tags[0], tags[1]
        tx = client.pipeline(transaction=True)
        tx.set(f"{a}:x", "1")
        tx.incr(f"{a}:y")
        assert tx.execute() == [b"OK", 1]
        script = "redis.call('SET', KEYS[2], ARGV[1]); return redis.call('GET', KEYS[1])"
        assert client.eval(script, 2, f"{a}:x", f"{a}:z", "v") == b"1"
        assert client.get(f"{a}:z") == b"v"

        # redis-py refuses cross-slot commands before sending them …
        with pytest.raises(RedisClusterException, match="same key slot"):
            client.mset({f"{a}:m": "1", f"{b}:m": "2"})
        with pytest.raises(RedisClusterException, match="same key slot"):
            client.eval(script, 2, f"{a}:x", f"{b}:x", "v")
        tx = client.pipeline(transaction=True)
        tx.set(f"{a}:t", "1")
        tx.set(f"{b}:t", "2")
        with pytest.raises(CrossSlotTransactionError):
            tx.execute()
    finally:
        client.close()
    # … and a node, asked directly, answers CROSSSLOT.
    with (
        redis.Redis.from_url(cluster.node_urls[0], socket_timeout=5) as node,
        pytest.raises(ClusterCrossSlotError),
    ):
        node.mset({f"{a}:m": "1", f"{b}:m": "2"})


@pytest.mark.timeout(60)
def test_kill_node_and_stop_leave_no_process_and_no_dir() -> None:
    with redis_cluster() as cluster:
        pids = [proc.pid for proc in cluster.procs if proc is not None]
        assert len(pids) == 3
        cluster.kill_node(1)
        with pytest.raises(ProcessLookupError):
            os.kill(pids[1], 0)
        for pid in (pids[0], pids[2]):
            os.kill(pid, 0)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not cluster.dir.exists()
    cluster.stop()  # idempotent
