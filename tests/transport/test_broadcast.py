"""The broadcast transport's group, buckets and tensors across real processes: gloo on CPU, NCCL on two GPUs."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tandem.config.resolve import free_port
from tandem.transport import broadcast
from tandem.transport.broadcast_types import WeightUpdateInfo, plan_buckets

RANK = Path(__file__).with_name("broadcast_rank.py")


def run_group(devices: list[str]) -> None:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(RANK), str(rank), str(len(devices)), str(port), device],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank, device in enumerate(devices)]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    for rank, (proc, output) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0 and f"ok {rank}" in output, output


@pytest.mark.slow
def test_gloo_group_carries_every_dtype_bit_for_bit():
    run_group(["cpu", "cpu", "cpu"])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="an NCCL group needs two GPUs (one rank per GPU)")
def test_nccl_group_carries_every_dtype_bit_for_bit():
    run_group(["cuda:0", "cuda:1"])


def test_buckets_close_on_the_tensor_that_passes_the_threshold():
    info = WeightUpdateInfo(names=["a", "b", "c", "d"], dtype_names=["float32", "bfloat16", "float32", "int64"],
                            shapes=[[10], [10], [1000], []], packed_buffer_size_bytes=50)
    buckets = plan_buckets(info)
    assert [b.names for b in buckets] == [["a", "b"], ["c"], ["d"]]
    assert [b.num_bytes for b in buckets] == [60, 4000, 8]


def test_bad_update_info_is_refused_before_any_receive():
    with pytest.raises(ValueError, match="differ in length"):
        WeightUpdateInfo(names=["a"], dtype_names=[], shapes=[[1]]).check()
    with pytest.raises(ValueError, match="'complex_bits'.*not a torch dtype"):
        WeightUpdateInfo(names=["a"], dtype_names=["complex_bits"], shapes=[[1]]).check()


def test_a_stream_is_taken_a_bucket_at_a_time_in_the_announced_order(monkeypatch):
    """A trainer sends its parameters as it gathers them: the next bucket's are not made before this one goes."""
    info = WeightUpdateInfo(names=["a", "b", "c"], dtype_names=["float32"] * 3, shapes=[[10], [10], [1000]],
                            packed_buffer_size_bytes=50)
    made, sent = [], []

    def tensors():
        for name, size in (("a", 10), ("b", 10), ("c", 1000)):
            made.append(name)
            yield name, torch.full((size,), float(len(made)))

    monkeypatch.setattr(broadcast, "_broadcast", lambda group, flat: sent.append((list(made), flat.view(torch.float32).tolist())))
    broadcast.send_state(None, tensors(), info, torch.device("cpu"))
    assert [(names, len(values)) for names, values in sent] == [(["a", "b"], 20), (["a", "b", "c"], 1000)]
    assert sent[0][1] == [1.0] * 10 + [2.0] * 10 and set(sent[1][1]) == {3.0}
    with pytest.raises(ValueError, match="sending 'b' where the announced update has 'a'"):
        broadcast.send_state(None, iter([("b", torch.zeros(10))]), info, torch.device("cpu"))
