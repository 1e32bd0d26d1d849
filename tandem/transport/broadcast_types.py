"""Wire types of the broadcast weight transport, with vLLM's weight-transfer field names.

Both are JSON bodies of the servers' weight-transfer routes, the same for tandem's engine and for
vLLM's (`docs/weight_transport.md`):
- `GroupInitInfo`, the `init_info` of `POST /init_weight_transfer_engine`: produced by the
  orchestrator (one per server: its `rank_offset`), consumed by each server to join the group
  whose rank 0 is the trainer.
- `WeightUpdateInfo`, the `update_info` of `POST /update_weights`: produced by trainer rank 0 as
  `broadcasts/step_N.json` just before it sends step N's tensors, relayed by the orchestrator to
  every server, consumed by each server to receive the buckets in the same order.

Buckets: tensors are taken in `names` order and appended to the current bucket until its size
passes `packed_buffer_size_bytes`; the tensor that passes it closes the bucket. One bucket is one
broadcast of a flat uint8 tensor. Sender and receivers derive the same buckets from the same info.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec
import torch


class GroupInitInfo(msgspec.Struct):
    master_address: str
    """Trainer rank 0's host, where the group's rendezvous store listens."""
    master_port: int
    rank_offset: int
    """Group rank of the server's first rank (the trainer is rank 0)."""
    world_size: int


class WeightUpdateInfo(msgspec.Struct):
    names: list[str]
    """HF parameter names, in the order they cross the group."""
    dtype_names: list[str]
    """`torch` dtype names (`bfloat16`, `float32`), one per name."""
    shapes: list[list[int]]
    packed: bool = True
    """Tensors travel packed into buckets (tandem always packs)."""
    packed_buffer_size_bytes: int = 2**30
    """Bucket size threshold (see the module docstring). vLLM's other packing field,
    `packed_num_buffers`, is left to its default on both of its ends."""

    def check(self) -> None:
        """Raise ValueError when the lists disagree or a dtype is unknown (a 400 on the servers)."""
        if not (len(self.names) == len(self.dtype_names) == len(self.shapes)):
            raise ValueError(f"`update_info` lists differ in length: {len(self.names)} names, "
                             f"{len(self.dtype_names)} dtype_names, {len(self.shapes)} shapes")
        for name in self.dtype_names:
            if not isinstance(getattr(torch, name, None), torch.dtype):
                raise ValueError(f"`update_info.dtype_names` holds {name!r}, which is not a torch dtype")
        if not self.packed:
            raise ValueError("`update_info.packed` = false: tandem's engine receives packed buckets only")


@dataclass
class Bucket:
    """Consecutive tensors of an update, sent as one flat uint8 broadcast."""

    names: list[str]
    dtypes: list[torch.dtype]
    shapes: list[list[int]]
    sizes: list[int]
    """Bytes of each tensor."""

    @property
    def num_bytes(self) -> int:
        return sum(self.sizes)


def plan_buckets(info: WeightUpdateInfo) -> list[Bucket]:
    """The buckets of an update, in sending order (the rule of the module docstring)."""
    buckets: list[Bucket] = []
    current = Bucket([], [], [], [])
    for name, dtype_name, shape in zip(info.names, info.dtype_names, info.shapes):
        dtype = getattr(torch, dtype_name)
        current.names.append(name)
        current.dtypes.append(dtype)
        current.shapes.append(list(shape))
        current.sizes.append(math.prod(shape) * dtype.itemsize)
        if current.num_bytes > info.packed_buffer_size_bytes:
            buckets.append(current)
            current = Bucket([], [], [], [])
    if current.names:
        buckets.append(current)
    return buckets


def update_info_of(state: dict[str, torch.Tensor], bucket_bytes: int) -> WeightUpdateInfo:
    """The update info describing `state` (sent in its iteration order)."""
    return WeightUpdateInfo(names=list(state), dtype_names=[str(t.dtype).removeprefix("torch.") for t in state.values()],
                            shapes=[list(t.shape) for t in state.values()], packed_buffer_size_bytes=bucket_bytes)


_encoder = msgspec.json.Encoder()


def encode_update_info(info: WeightUpdateInfo) -> bytes:
    return _encoder.encode(info)


def decode_update_info(data: bytes | str) -> WeightUpdateInfo:
    return msgspec.json.decode(data, type=WeightUpdateInfo)
