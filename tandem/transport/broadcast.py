"""The broadcast weight transport: a torch.distributed group from trainer rank 0 to the servers.

The group stands apart from the trainer's own (FSDP) group: it has its own rendezvous store on
trainer rank 0 (`GroupInitInfo.master_address:master_port`) and is built as a bare process group,
never registered as torch's default one. NCCL on CUDA, gloo on CPU: both ends of a group must be
on the same kind of device. Rank 0 sends, every other rank receives, bucket by bucket (the rule of
`broadcast_types`); a collective that cannot complete within the group's timeout raises.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable

import torch
import torch.distributed as dist

from tandem.transport.broadcast_types import GroupInitInfo, WeightUpdateInfo, plan_buckets

SOURCE_RANK = 0
"""The trainer's rank in the group."""


def open_group(init: GroupInitInfo, rank: int, device: torch.device, timeout_s: float) -> dist.ProcessGroup:
    """Join the group as `rank` (0 hosts the store); returns once all `world_size` ranks joined."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(init.master_address, init.master_port, init.world_size, is_master=rank == SOURCE_RANK,
                          timeout=timeout, wait_for_workers=False)
    group = bare_group(dist.PrefixStore("tandem-weights", store), rank, init.world_size, device, timeout)
    _barrier(group, device)  # the group exists once every rank joined, not when this rank did
    return group


def bare_group(store: dist.Store, rank: int, world_size: int, device: torch.device,
               timeout: datetime.timedelta) -> dist.ProcessGroup:
    """A process group over `store` that is not torch's default one (so a process may hold several): NCCL for
    CUDA tensors, gloo for CPU ones."""
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def send_state(group: dist.ProcessGroup, tensors: Iterable[tuple[str, torch.Tensor]], info: WeightUpdateInfo,
               device: torch.device) -> None:
    """Rank 0: broadcast the (name, tensor) pairs of `tensors`, in `info`'s order, bucket by bucket. They are
    taken one at a time as each bucket fills, so a source that makes them one at a time (a trainer gathering
    its parameters) never holds more than a bucket."""
    stream = iter(tensors)
    for bucket in plan_buckets(info):
        parts = []
        for name in bucket.names:
            got, tensor = next(stream)
            if got != name:
                raise ValueError(f"sending {got!r} where the announced update has {name!r}")
            parts.append(tensor.detach().to(device).reshape(-1).view(torch.uint8))
        _broadcast(group, torch.cat(parts))


def receive_state(group: dist.ProcessGroup, info: WeightUpdateInfo, device: torch.device) -> dict[str, torch.Tensor]:
    """Ranks > 0: receive the tensors `info` announces; returns them by name, on `device`."""
    state = {}
    for bucket in plan_buckets(info):
        flat = torch.empty(bucket.num_bytes, dtype=torch.uint8, device=device)
        _broadcast(group, flat)
        for name, dtype, shape, part in zip(bucket.names, bucket.dtypes, bucket.shapes, flat.split(bucket.sizes)):
            if part.storage_offset() % dtype.itemsize:  # after an odd-sized tensor: copy to an aligned start
                part = part.clone()
            state[name] = part.view(dtype).view(shape)
    return state


def close_group(group: dist.ProcessGroup) -> None:
    """Tear the group down now; the caller then drops its last reference, so that the group is freed
    now too. Freed only at interpreter exit, its gloo threads may reach for the GIL while stopping,
    and Python ends them inside a C++ frame: the process aborts (exit code -6 after the last update,
    one run in four with gloo on a loaded machine)."""
    group.shutdown()


def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = SOURCE_RANK
    group.broadcast([tensor], options).wait()


def _barrier(group: dist.ProcessGroup, device: torch.device) -> None:
    # A one-element broadcast rather than `barrier()`: NCCL's barrier guesses its device.
    _broadcast(group, torch.zeros(1, device=device))
