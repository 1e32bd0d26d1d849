"""The broadcast transport's group, buckets and tensors across real processes: gloo on CPU, NCCL on two GPUs."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tandem.config.resolve import free_port
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
