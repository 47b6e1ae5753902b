"""Scheduler: decode-first token budget, chunked prefill, preemption order, max_loras, FCFS fairness."""

from __future__ import annotations

from loragate.types import Request
from worker.block_manager import BlockManager
from worker.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from worker.sequence import Sequence, SequenceStatus

BS = 4


def make(num_blocks: int = 64, **kw: int) -> Scheduler:
    return Scheduler(SchedulerConfig(**kw), BlockManager(num_blocks, BS))


def seq(rid: str, n: int, adapter: str | None = None) -> Sequence:
    """Distinct requests get distinct tokens, so no prefix is shared unless a test shares it."""
    base = 1000 * (sum(map(ord, rid)) % 97 + 1)
    return Sequence.from_request(Request(rid, tuple(range(base, base + n)), adapter=adapter))


def run(s: Scheduler, out: SchedulerOutput, sample: int = 7) -> None:
    """Apply a step as the engine would: tokens computed; sequences that reached the end sample one."""
    for q, n in out.scheduled:
        q.num_computed_tokens += n
        s.blocks.commit(q)
        if q.num_computed_tokens == q.num_tokens:
            q.token_ids.append(sample)


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(q.request_id, n) for q, n in out.scheduled]


def test_new_requests_are_admitted_in_arrival_order_within_budget() -> None:
    s = make(max_num_batched_tokens=20)
    for rid, n in (("a", 8), ("b", 8), ("c", 8)):
        s.add(seq(rid, n))
    out = s.schedule()
    assert plan(out) == [("a", 8), ("b", 8), ("c", 4)]  # c gets a partial chunk


def test_decodes_go_first_then_chunked_prefill() -> None:
    s = make(max_num_batched_tokens=10)
    s.add(seq("a", 6))
    run(s, s.schedule())  # a prefilled, sampled one token
    s.add(seq("b", 30))
    out = s.schedule()
    assert plan(out) == [("a", 1), ("b", 9)]
    run(s, out)
    out = s.schedule()
    assert plan(out) == [("a", 1), ("b", 9)]  # b continues its prefill in chunks
    run(s, out)
    run(s, s.schedule())
    out = s.schedule()
    assert plan(out) == [("a", 1), ("b", 3)]  # the last chunk ends the prompt
    run(s, out)
    assert plan(s.schedule()) == [("a", 1), ("b", 1)]


def test_max_num_seqs_bounds_running() -> None:
    s = make(max_num_seqs=2)
    for rid in "abc":
        s.add(seq(rid, 3))
    assert [q.request_id for q, _ in s.schedule().scheduled] == ["a", "b"]
    assert [q.request_id for q in s.waiting] == ["c"]


def test_preemption_evicts_the_newest_running_and_requeues_it_first() -> None:
    s = make(num_blocks=4)  # 16 token slots
    a, b = seq("a", 8), seq("b", 7)
    s.add(a)
    s.add(b)
    run(s, s.schedule())  # a: 2 blocks (9 tokens after sampling), b: 2 blocks (8 tokens)
    assert s.blocks.num_free_blocks == 0
    out = s.schedule()  # a needs a 3rd block for its 9th token: b is preempted
    assert [q.request_id for q in out.preempted] == ["b"]
    assert plan(out) == [("a", 1)]
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert list(s.waiting) == [b] and b.num_preemptions == 1
    # The sampled token is kept: recompute resumes where it was.
    assert b.token_ids[-1] == 7 and b.num_tokens == 8


def test_a_sequence_preempts_itself_when_it_is_the_only_one() -> None:
    s = make(num_blocks=2)
    a = seq("a", 8)
    s.add(a)
    run(s, s.schedule())
    out = s.schedule()
    assert out.preempted == [a] and out.scheduled == []
    assert list(s.waiting) == [a]


def test_no_admission_in_a_step_that_preempted() -> None:
    s = make(num_blocks=4)
    s.add(seq("a", 8))
    s.add(seq("b", 7))
    run(s, s.schedule())
    s.add(seq("c", 1))
    out = s.schedule()
    assert out.preempted and all(q.request_id != "c" for q, _ in out.scheduled)


def test_preempted_request_resumes_from_prefix_cache() -> None:
    s = make(num_blocks=4)
    a, b = seq("a", 8), seq("b", 7)
    s.add(a)
    s.add(b)
    run(s, s.schedule())
    run(s, s.schedule())  # b preempted; a decodes
    s.remove(a)  # a finishes and frees its blocks
    out = s.schedule()
    assert plan(out) == [("b", 4)]  # b's first full block came back from the prefix cache
    assert b.num_cached_tokens == 4


def test_max_loras_lets_other_adapters_pass_but_keeps_order() -> None:
    s = make(max_loras=2)
    for rid, ad in (("a", "x"), ("b", "y"), ("c", "z"), ("d", "x"), ("e", None)):
        s.add(seq(rid, 3, ad))
    out = s.schedule()
    assert [q.request_id for q, _ in out.scheduled] == ["a", "b", "d", "e"]
    assert [q.request_id for q in s.waiting] == ["c"]


def test_max_lora_skips_stops_admission_so_the_head_cannot_starve() -> None:
    s = make(max_loras=1, max_lora_skips=2)
    s.add(seq("a", 3, "x"))
    run(s, s.schedule())
    s.add(seq("blocked", 3, "y"))
    for i in range(2):
        s.add(seq(f"x{i}", 3, "x"))
        out = s.schedule()
        assert f"x{i}" in [q.request_id for q, _ in out.scheduled]
        run(s, out)
    s.add(seq("late", 3, "x"))
    out = s.schedule()
    assert "late" not in [q.request_id for q, _ in out.scheduled]  # admission paused for the head
    for q in list(s.running):
        s.remove(q)
    out = s.schedule()
    assert [q.request_id for q, _ in out.scheduled] == ["blocked"]


def test_kv_exhaustion_stops_admission_in_fcfs_order() -> None:
    s = make(num_blocks=3)
    s.add(seq("big", 10))
    s.add(seq("small", 2))
    out = s.schedule()
    assert plan(out) == [("big", 10)]
    assert [q.request_id for q in s.waiting] == ["small"]  # would fit, but must not overtake
