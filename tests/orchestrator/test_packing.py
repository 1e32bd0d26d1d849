"""Packing invariants: row lengths, token accounting, rank balance, truncation."""

import random

import pytest

from tandem.orchestrator.packing import PackingStats, balance, pack_step
from tandem.orchestrator.samples import Sample
from tandem.transport.types import TrainingBatch, decode_batch, encode_batch

PAD = 259


def make_sample(rng: random.Random, uid: int, length: int) -> Sample:
    prompt = rng.randint(1, max(1, length - 1))
    s = Sample(token_ids=[uid] * length, loss_mask=[0] * prompt + [1] * (length - prompt),
               logprobs=[0.0] * prompt + [-1.0] * (length - prompt), temperatures=[0.9] * length,
               versions=[uid % 3], advantage=rng.uniform(-1, 1))
    return s


@pytest.mark.parametrize("seed", range(20))
def test_invariants_hold_for_random_batches(seed):
    rng = random.Random(seed)
    seq_len, num_ranks = rng.choice([16, 64, 100]), rng.choice([1, 2, 3, 4])
    lengths = [rng.randint(2, int(seq_len * 1.3)) for _ in range(rng.randint(0, 40))]
    samples = [make_sample(rng, uid, n) for uid, n in enumerate(lengths)]
    assert_packing_invariants(samples, seq_len, num_ranks)


LONG = 131072
"""A 128k-token `seq_len`: reasoning rollouts of 32k-128k tokens."""


def test_invariants_and_truncation_hold_at_128k_tokens():
    """Samples around 128k tokens: one over by one token and one far over are cut (and counted), one of
    exactly `seq_len` is not; shorter ones share rows up to exactly `seq_len`; the batch survives the wire format."""
    rng = random.Random(0)
    lengths = [LONG + 1, LONG + 40_000, LONG, 100_000, 31_072, 65_537, 65_535, 32_768, 17, 2]
    samples = [make_sample(rng, uid, n) for uid, n in enumerate(lengths)]
    batches, stats = assert_packing_invariants(samples, LONG, num_ranks=4)
    assert stats.num_truncated == 2
    # rows filled to exactly 128k: 3 whole (2 cut) samples, 65,537 + 65,535 and 100,000 + 31,072; the rest share one
    assert sorted(len(row.input_ids) for b in batches for row in b.rows if set(row.input_ids) != {PAD}) == \
        [32_768 + 17 + 2] + [LONG] * 5
    for batch in batches:
        assert decode_batch(encode_batch(batch)) == batch


def assert_packing_invariants(samples: list[Sample], seq_len: int, num_ranks: int) -> tuple[list[TrainingBatch], PackingStats]:
    """`pack_step`'s invariants (module docstring of `tandem.orchestrator.packing`) for these samples."""
    lengths = [len(s) for s in samples]
    expected = {i: min(n, seq_len) for i, n in enumerate(lengths)}
    expected_loss = sum(sum(s.loss_mask[:seq_len]) for s in samples)
    advantages = {uid: [s.advantage * m for m in s.loss_mask[:seq_len]] for uid, s in enumerate(samples)}

    batches, stats = pack_step(7, samples, seq_len, num_ranks, PAD)

    assert [b.rank for b in batches] == list(range(num_ranks)) and {b.step for b in batches} == {7}
    assert len({len(b.rows) for b in batches}) == 1, "every rank gets the same number of rows"
    assert stats.num_truncated == sum(n > seq_len for n in lengths)
    seen: dict[int, int] = {}
    for batch in batches:
        assert batch.num_loss_tokens == expected_loss
        for row in batch.rows:
            n = len(row.input_ids)
            assert 2 <= n <= seq_len
            assert all(len(getattr(row, f)) == n for f in ("position_ids", "loss_mask", "logprobs", "advantages", "temperatures"))
            assert row.position_ids[0] == 0
            if set(row.input_ids) == {PAD}:
                assert row.loss_mask == [0, 0]  # padding row
                continue
            # split the row back into samples at position resets: each is one whole sample
            starts = [t for t, p in enumerate(row.position_ids) if p == 0] + [n]
            for a, b in zip(starts, starts[1:]):
                uid = row.input_ids[a]
                assert row.input_ids[a:b] == [uid] * (b - a) and uid not in seen
                assert row.position_ids[a:b] == list(range(b - a))
                assert row.loss_mask[a] == 0
                seen[uid] = b - a
                assert row.advantages[a:b] == advantages[uid]
    assert seen == expected, "every token of every sample is in exactly one row"
    assert sum(b.num_loss_tokens for b in batches[:1]) == sum(sum(r.loss_mask) for b in batches for r in b.rows)
    if stats.num_rows >= num_ranks:
        assert max(stats.tokens_per_rank) - min(stats.tokens_per_rank) <= seq_len
    assert sorted(v for b in batches for v in b.policy_versions) == sorted(s.versions[0] for s in samples)
    return batches, stats


def test_balance_keeps_counts_equal_and_loads_close():
    ranks = balance([10, 9, 8, 1, 1, 1], num_ranks=2)
    assert sorted(len(r) for r in ranks) == [3, 3]
    loads = [sum([10, 9, 8, 1, 1, 1][i] for i in r) for r in ranks]
    assert abs(loads[0] - loads[1]) <= 10


def test_an_empty_step_gives_each_rank_one_padding_row():
    batches, stats = pack_step(3, [], 32, 2, PAD)
    assert [len(b.rows) for b in batches] == [1, 1]
    assert all(b.num_loss_tokens == 0 and b.rows[0].loss_mask == [0, 0] for b in batches)
    assert stats.num_padding_rows == 2
