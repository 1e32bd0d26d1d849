"""The process group, the device and the device meshes of one trainer rank.

Every run has a process group, also at world size 1 without torchrun (an in-process `HashStore`,
no port): FSDP, DCP and the collectives then take one code path whatever the world size, which is
what makes a 1-rank run and an N-rank run comparable step by step.

Meshes (torchtitan's layout): every rank is a data-parallel rank, and expert parallelism borrows
its ranks from data parallelism instead of adding ranks.

    dense  mesh  (dp_shard,)      = (world,)               FSDP of everything outside the routed experts
    expert mesh  (efsdp, ep)      = (world / ep, ep)       routed experts: Shard(0) over `ep`, FSDP over `efsdp`

Both are views of the same world mesh, so a rank's `ep` group is `ep` consecutive ranks (one
node's fast links carry the all-to-all) and FSDP can compose the two axes on one parameter. The
expert mesh exists only when `ep` > 1; context parallelism adds its axis here, not in the loops.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

DP_SHARD = "dp_shard"
"""Mesh axis over which FSDP shards the dense parameters, gradients and optimizer state (all ranks)."""
EP = "ep"
"""Mesh axis over which each MoE block's routed experts are split (dim 0 of the expert weights)."""
EFSDP = "efsdp"
"""Mesh axis over which FSDP shards the routed experts: the data-parallel ranks left once `ep` is taken."""


@dataclass
class ParallelDims:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh
    """The dense mesh, one axis `dp_shard` over all ranks."""
    expert_mesh: DeviceMesh | None = None
    """(efsdp, ep) over all ranks when `ep_size` > 1, else None (experts are dense parameters)."""

    @property
    def is_main(self) -> bool:
        """Rank 0 writes the files and metrics that exist once per run."""
        return self.rank == 0

    @property
    def dp_size(self) -> int:
        """Ranks that split each step's batch: all of them (EP borrows data-parallel ranks)."""
        return self.mesh[DP_SHARD].size()

    @property
    def ep_size(self) -> int:
        return 1 if self.expert_mesh is None else self.expert_mesh[EP].size()


def resolve_device(device: Literal["auto", "cpu", "cuda"], local_rank: int) -> torch.device:
    """`auto` takes CUDA when present; under torchrun each rank takes the GPU of its LOCAL_RANK."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("`device` = 'cuda' but torch sees no CUDA device; use `--device cpu`")
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} CUDA devices are visible")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_parallel(device: Literal["auto", "cpu", "cuda"], ep: int = 1) -> ParallelDims:
    """Join torchrun's process group (env://), or make a world of one; build the meshes.

    `ep`: expert-parallel size (`parallel.ep`), a divisor of the world size."""
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    local_rank = int(os.environ.get("LOCAL_RANK", 0)) if launched else 0
    world_env = int(os.environ["WORLD_SIZE"]) if launched else 1
    if ep < 1 or world_env % ep:
        raise ValueError(f"`parallel.ep` = {ep} must divide the world size {world_env} (EP borrows data-parallel ranks)")
    dev = resolve_device(device, local_rank)
    # CUDA runs also get gloo for the CPU-side collectives that DCP and object gathers use.
    backend = "cuda:nccl,cpu:gloo" if dev.type == "cuda" else "gloo"
    if not dist.is_initialized():
        if launched:
            dist.init_process_group(backend, device_id=dev if dev.type == "cuda" else None)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    world = dist.get_world_size()
    mesh = init_device_mesh(dev.type, (world,), mesh_dim_names=(DP_SHARD,))
    expert_mesh = mesh._unflatten(0, (world // ep, ep), (EFSDP, EP)) if ep > 1 else None
    return ParallelDims(rank=dist.get_rank(), world_size=world, local_rank=local_rank, device=dev, mesh=mesh,
                        expert_mesh=expert_mesh)


def close_parallel() -> None:
    """Tear the process group down (in-process callers such as tests may open another)."""
    if dist.is_initialized():
        dist.destroy_process_group()
