"""One rank of a broadcast-transport test: rank 0 sends `expected_state()`, the others receive and compare.

Usage: python broadcast_rank.py RANK WORLD_SIZE PORT DEVICE   (DEVICE: cpu, or cuda:N for an NCCL group)
"""

import sys

import torch

from tandem.kernels.fp8 import FP8
from tandem.models.fp8 import quantize_weight
from tandem.transport.broadcast import close_group, open_group, receive_state, send_state
from tandem.transport.broadcast_types import GroupInitInfo, decode_update_info, encode_update_info, update_info_of


def expected_state() -> dict[str, torch.Tensor]:
    """Mixed dtypes, a scalar, a non-contiguous tensor, and an FP8 weight of an odd size before its fp32 scales
    (they arrive at an unaligned offset): each must cross bit for bit."""
    g = torch.Generator().manual_seed(0)
    fp8, scale_inv = quantize_weight(torch.randn(131, 7, generator=g))
    return {"a.weight": torch.randn(64, 33, generator=g).to(torch.bfloat16),
            "b.bias": torch.randn(7, generator=g),
            "c.count": torch.tensor(12345, dtype=torch.int64),
            "d.weight": torch.randn(40, 50, generator=g).t(),
            "e.weight": torch.randn(300, generator=g).half(),
            "f.weight": fp8, "f.weight_scale_inv": scale_inv}


def main(rank: int, world_size: int, port: int, device: torch.device) -> None:
    """A function, so that the group is freed when it returns, not at interpreter exit (`close_group`)."""
    group = open_group(GroupInitInfo("127.0.0.1", port, 1, world_size), rank, device, timeout_s=60)
    state = expected_state()
    # 4 KiB buckets: the 8 KiB bf16 tensor closes a bucket alone, the small ones share one.
    info = decode_update_info(encode_update_info(update_info_of(state, bucket_bytes=4096)))
    if rank == 0:
        send_state(group, state.items(), info, device)
    else:
        received = receive_state(group, info, device)
        assert list(received) == list(state)
        for name, tensor in state.items():
            got = received[name]
            assert got.device == device and got.dtype == tensor.dtype and got.shape == tensor.shape, name
            bits = (lambda t: t.view(torch.uint8)) if tensor.dtype == FP8 else (lambda t: t)
            assert torch.equal(bits(got.cpu()), bits(tensor)), name
    close_group(group)
    print("ok", rank, flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), torch.device(sys.argv[4]))
