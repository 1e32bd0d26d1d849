"""The RL trainer's input checks, batch waiting, and world-size-independent fake batches."""

from __future__ import annotations

import msgspec
import pytest
import torch

from tandem.config.trainer import RolloutDataConfig
from tandem.trainer.data import BatchError, check_batch, fake_batch, wait_for_batch
from tandem.transport.paths import rollout_file
from tandem.transport.types import PackedRow, TrainingBatch

from trainer_helpers import random_row, write_rollouts


def good_row() -> PackedRow:
    return random_row(torch.Generator().manual_seed(0), [(3, 4), (2, 5)])


def batch_of(row: PackedRow) -> TrainingBatch:
    return TrainingBatch(step=1, rank=0, rows=[row], num_loss_tokens=sum(row.loss_mask))


def test_a_good_row_passes():
    check_batch(batch_of(good_row()), seq_len=64, vocab_size=260, source="f")


@pytest.mark.parametrize("change, message", [
    (lambda r: r.logprobs.pop(), "14 input_ids but 13 logprobs"),
    (lambda r: r.loss_mask.__setitem__(0, 1), "first token of a sample"),
    (lambda r: r.loss_mask.__setitem__(7, 1), "first token of a sample"),  # token 7 starts the second sample
    (lambda r: r.position_ids.__setitem__(0, 3), "must start at 0"),
    (lambda r: r.input_ids.__setitem__(2, 260), r"\[0, 260\)"),
    (lambda r: r.temperatures.__setitem__(5, 0.0), "temperatures of loss tokens"),
    (lambda r: r.advantages.__setitem__(5, float("nan")), "advantages must be finite"),
    (lambda r: r.loss_mask.__setitem__(5, 2), "0 or 1"),
], ids=["lengths", "first-token", "sample-start", "positions", "vocab", "temperature", "nan", "mask-value"])
def test_bad_rows_are_refused_with_the_reason(change, message):
    row = good_row()
    change(row)
    with pytest.raises(BatchError, match=message):
        check_batch(batch_of(row), seq_len=64, vocab_size=260, source="rollouts/step_1/rank_0.msgpack")


def test_rows_longer_than_seq_len_are_refused():
    with pytest.raises(BatchError, match="seq_len = 8"):
        check_batch(batch_of(good_row()), seq_len=8, vocab_size=260, source="f")


def test_wait_for_batch_reads_the_file_once_it_exists(tmp_path):
    rows = [good_row()]
    write_rollouts(tmp_path, 2, rows, rank=1)
    batch = wait_for_batch(tmp_path, 2, 1, poll_interval_s=0.01, timeout_s=1)
    assert batch.rows == rows and batch.num_loss_tokens == sum(rows[0].loss_mask)


def test_wait_for_batch_times_out_naming_the_file(tmp_path):
    with pytest.raises(BatchError, match="rank_0.msgpack does not exist"):
        wait_for_batch(tmp_path, 1, 0, poll_interval_s=0.01, timeout_s=0.05)


def test_wait_for_batch_refuses_a_file_of_another_step_or_garbage(tmp_path):
    write_rollouts(tmp_path, 3, [good_row()])
    rollout_file(tmp_path, 4, 0).parent.mkdir(parents=True)
    rollout_file(tmp_path, 4, 0).write_bytes(rollout_file(tmp_path, 3, 0).read_bytes())
    with pytest.raises(BatchError, match="holds step 3 rank 0, expected step 4"):
        wait_for_batch(tmp_path, 4, 0, 0.01, 1)
    rollout_file(tmp_path, 5, 0).parent.mkdir(parents=True)
    rollout_file(tmp_path, 5, 0).write_bytes(msgspec.msgpack.encode({"not": "a batch"}))
    with pytest.raises(BatchError, match="not a TrainingBatch"):
        wait_for_batch(tmp_path, 5, 0, 0.01, 1)


def test_fake_batches_are_the_same_rows_at_any_world_size():
    config = RolloutDataConfig(fake=True, fake_rows=4, fake_samples_per_row=2)
    whole = fake_batch(3, 0, 1, config, seq_len=32, vocab_size=260, seed=5)
    halves = [fake_batch(3, r, 2, config, seq_len=32, vocab_size=260, seed=5) for r in range(2)]
    assert whole.rows == halves[0].rows + halves[1].rows
    assert whole.num_loss_tokens == halves[0].num_loss_tokens == sum(sum(r.loss_mask) for r in whole.rows) == 4 * 2 * 8
    assert fake_batch(4, 0, 1, config, 32, 260, 5).rows != whole.rows
    check_batch(whole, seq_len=32, vocab_size=260, source="fake")
    with pytest.raises(BatchError, match="multiple of the world size"):
        fake_batch(1, 0, 3, config, 32, 260, 5)
