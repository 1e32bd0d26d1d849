"""The process group, the device and the device mesh of one trainer rank.

Every run has a process group, also at world size 1 without torchrun (an in-process `HashStore`,
no port): FSDP, DCP and the collectives then take one code path whatever the world size, which is
what makes a 1-rank run and an N-rank run comparable step by step. The mesh has a single axis,
`dp_shard`, today; expert and context parallelism add axes here, not in the training loop.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

DP_SHARD = "dp_shard"
"""Mesh axis over which FSDP shards parameters, gradients and optimizer state."""


@dataclass
class ParallelDims:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh

    @property
    def is_main(self) -> bool:
        """Rank 0 writes the files and metrics that exist once per run."""
        return self.rank == 0

    @property
    def dp_size(self) -> int:
        """Ranks that split each step's batch (all of them, until other axes exist)."""
        return self.mesh[DP_SHARD].size()


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


def init_parallel(device: Literal["auto", "cpu", "cuda"]) -> ParallelDims:
    """Join torchrun's process group (env://), or make a world of one; build the mesh."""
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    local_rank = int(os.environ.get("LOCAL_RANK", 0)) if launched else 0
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
    return ParallelDims(rank=dist.get_rank(), world_size=world, local_rank=local_rank, device=dev, mesh=mesh)


def close_parallel() -> None:
    """Tear the process group down (in-process callers such as tests may open another)."""
    if dist.is_initialized():
        dist.destroy_process_group()
