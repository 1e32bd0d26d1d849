"""The filesystem rollout transport: atomic, decodable, one file per rank."""

import os
import threading

import pytest

from tandem.transport.paths import rollout_file
from tandem.transport.rollouts import FilesystemRolloutSender, setup_rollout_sender
from tandem.transport.types import PackedRow, TrainingBatch, decode_batch


def batch(step, rank, num_rows):
    row = PackedRow(list(range(500)), list(range(500)), [0] + [1] * 499, [-0.5] * 500, [0.25] * 500, [1.0] * 500)
    return TrainingBatch(step=step, rank=rank, rows=[row] * num_rows, num_loss_tokens=499 * num_rows * 2,
                         policy_versions=[step - 1] * num_rows)


def test_files_round_trip_and_leave_no_tmp_files(tmp_path):
    sender = setup_rollout_sender("filesystem", tmp_path)
    batches = [batch(4, 0, 2), batch(4, 1, 2)]
    sender.send(4, batches)
    for rank in range(2):
        assert decode_batch(rollout_file(tmp_path, 4, rank).read_bytes()) == batches[rank]
    assert sorted(os.listdir(rollout_file(tmp_path, 4, 0).parent)) == ["rank_0.msgpack", "rank_1.msgpack"]


def test_a_reader_never_sees_a_partial_file(tmp_path):
    """Rewrite one step's file many times while a reader decodes whatever is there."""
    sender = FilesystemRolloutSender(tmp_path)
    path = rollout_file(tmp_path, 1, 0)
    sender.send(1, [batch(1, 0, 1)])
    stop, errors, reads = threading.Event(), [], [0]

    def reader():
        while not stop.is_set():
            try:
                decode_batch(path.read_bytes())
                reads[0] += 1
            except Exception as err:  # a torn file would fail to decode
                errors.append(err)

    thread = threading.Thread(target=reader)
    thread.start()
    for i in range(200):
        sender.send(1, [batch(1, 0, 1 + i % 7)])
    stop.set()
    thread.join()
    assert not errors and reads[0] > 0


def test_mislabelled_batches_and_unknown_transports_are_errors(tmp_path):
    with pytest.raises(ValueError, match="sent as step 2 rank 0"):
        FilesystemRolloutSender(tmp_path).send(2, [batch(1, 0, 1)])
    with pytest.raises(ValueError, match="unknown rollout transport type 'zmq'"):
        setup_rollout_sender("zmq", tmp_path)
