"""Continuous batching: token budget, admission control, preemption, prefix-sharing waits."""

from tandem.inference.engine.block_manager import BlockManager
from tandem.inference.engine.sampling_params import SamplingParams
from tandem.inference.engine.scheduler import Scheduler
from tandem.inference.engine.sequence import Sequence, SequenceStatus
from tandem.models.byte_tokenizer import build_byte_tokenizer

TOKENIZER = build_byte_tokenizer()


def seq(n: int, request_id: str = "r", first: int | None = None) -> Sequence:
    """A sequence of n prompt tokens from `first` on (by default, different per request id)."""
    first = 10 * (ord(request_id) - ord("a")) if first is None else first
    return Sequence(request_id, 0, [first + i for i in range(n)], SamplingParams(max_tokens=100), TOKENIZER)


def run_step(sched: Scheduler) -> dict[str, int]:
    """Schedule, pretend the model ran, append a token to every sequence that sampled."""
    batch = sched.schedule()
    for i, (s, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
        samples = batch.samples(i)
        s.num_computed_tokens += n
        sched.block_manager.register_computed_blocks(s)
        if samples:
            s.mark_pending(0)
            s.append_token(7, -1.0, [], 0)
    return {s.request_id: n for s, n in zip(batch.seqs, batch.num_new_tokens)}


def test_long_prompt_is_prefilled_in_chunks_within_the_budget():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    sched.add(seq(25, "a"))
    assert [run_step(sched)["a"] for _ in range(4)] == [10, 10, 5, 1]


def test_decodes_come_before_prefill_chunks():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=8)
    sched.add(seq(3, "a"))
    run_step(sched)  # a prefilled, now decoding
    sched.add(seq(30, "b"))
    assert run_step(sched) == {"a": 1, "b": 7}


def test_request_waits_when_blocks_are_short_then_runs():
    sched = Scheduler(BlockManager(4, 4), max_num_seqs=8, max_num_batched_tokens=64)
    a, b = seq(10, "a"), seq(10, "b")
    sched.add(a)
    sched.add(b)
    assert run_step(sched) == {"a": 10}
    assert b.status is SequenceStatus.WAITING
    sched.finish(a, "stop")
    assert run_step(sched) == {"b": 10}


def test_max_num_seqs_caps_the_batch():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=64)
    for name in "abc":
        sched.add(seq(3, name))
    assert set(run_step(sched)) == {"a", "b"}


def test_running_out_of_blocks_preempts_the_newest_and_recomputes_it():
    sched = Scheduler(BlockManager(4, 4), max_num_seqs=8, max_num_batched_tokens=64)
    a, b = seq(7, "a"), seq(7, "b")
    sched.add(a)
    sched.add(b)
    run_step(sched)  # both prefilled: 2 blocks each, the cache is full; each now holds 8 tokens
    run_step(sched)  # each computes its 8th token into its last free slot and samples a 9th
    run_step(sched)  # a needs a third block: b, the newest, is preempted
    assert sched.num_preemptions == 1 and b.status is SequenceStatus.WAITING
    assert b.num_computed_tokens == 0 and b.num_completion_tokens == 2  # its completion is kept
    sched.finish(a, "stop")
    # Prompt and completion are prefilled again, but for its first block, still in the prefix cache.
    assert run_step(sched) == {"b": 9 - 4}


def test_same_prefix_waits_for_the_first_prefill_then_shares_its_blocks():
    sched = Scheduler(BlockManager(32, 4), max_num_seqs=8, max_num_batched_tokens=64)
    first, second, other = seq(18, "a", first=0), seq(18, "b", first=0), seq(18, "c")
    for s in (first, second, other):
        sched.add(s)
    step1 = sched.schedule()
    assert step1.seqs == [first, other]
    first.num_computed_tokens = 18
    sched.block_manager.register_computed_blocks(first)
    first.mark_pending(0)
    first.append_token(7, -1.0, [], 0)
    other.num_computed_tokens = 18
    other.mark_pending(1)
    other.append_token(7, -1.0, [], 0)
    step2 = sched.schedule()
    assert step2.seqs == [first, other, second]
    assert step2.num_new_tokens == [1, 1, 2]  # 16 of its 18 prompt tokens come from the cache
    sched.finish(first, "stop")
    assert sched.prefill_leaders == {(False, tuple(other.token_ids[:16])): other}
