"""The process group, the device and the device meshes of one trainer rank.

Every run has a process group, also at world size 1 without torchrun (an in-process `HashStore`,
no port): FSDP, DCP and the collectives then take one code path whatever the world size, which is
what makes a 1-rank run and an N-rank run comparable step by step.

Meshes (torchtitan's layout): every rank is an FSDP rank, and expert and context parallelism
borrow their ranks from it instead of adding ranks.

    dense   mesh  (dp_shard,)      = (world,)               FSDP of everything outside the routed experts
    expert  mesh  (efsdp, ep)      = (world / ep, ep)       routed experts: Shard(0) over `ep`, FSDP over `efsdp`
    context mesh  (dp, cp)         = (world / cp, cp)       each row's tokens split over `cp`; `dp` groups read different rows

All are views of the same world mesh, so a rank's `ep` (or `cp`) group is consecutive ranks (one
node's fast links carry the all-to-all or the ring) and FSDP can compose the axes on one
parameter. The expert mesh exists only when `ep` > 1, the context mesh only when `cp` > 1. FSDP
shards and averages over all ranks whatever `cp` is: the ranks of a `cp` group hold the
gradients of different tokens of the same rows, which add up.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tandem.trainer.parallel.watchdog import start_rank_watchdog

DP_SHARD = "dp_shard"
"""Mesh axis over which FSDP shards the dense parameters, gradients and optimizer state (all ranks)."""
EP = "ep"
"""Mesh axis over which each MoE block's routed experts are split (dim 0 of the expert weights)."""
EFSDP = "efsdp"
"""Mesh axis over which FSDP shards the routed experts: the data-parallel ranks left once `ep` is taken."""
CP = "cp"
"""Mesh axis over which the tokens of each packed row are split (context parallelism, ring attention)."""
DP = "dp"
"""Mesh axis of the context mesh over which rows are split: the `cp` groups."""


_ROOT_MESHES: list[DeviceMesh] = []
"""The world meshes `init_parallel` built and `close_parallel` has yet to release (see `close_parallel`)."""


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
    context_mesh: DeviceMesh | None = None
    """(dp, cp) over all ranks when `cp_size` > 1, else None (every rank holds whole rows)."""

    @property
    def is_main(self) -> bool:
        """Rank 0 writes the files and metrics that exist once per run."""
        return self.rank == 0

    @property
    def dp_size(self) -> int:
        """Ranks over which FSDP averages the gradients: all of them (EP and CP borrow FSDP's ranks)."""
        return self.mesh[DP_SHARD].size()

    @property
    def ep_size(self) -> int:
        return 1 if self.expert_mesh is None else self.expert_mesh[EP].size()

    @property
    def cp_size(self) -> int:
        return 1 if self.context_mesh is None else self.context_mesh[CP].size()

    @property
    def cp_mesh(self) -> DeviceMesh | None:
        """The 1-D `cp` mesh of this rank's context-parallel group (None when `cp_size` is 1)."""
        return None if self.context_mesh is None else self.context_mesh[CP]


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


def init_parallel(device: Literal["auto", "cpu", "cuda"], ep: int = 1, cp: int = 1) -> ParallelDims:
    """Join torchrun's process group (env://), or make a world of one; build the meshes.

    `ep`, `cp`: expert- and context-parallel sizes (`parallel.ep`, `parallel.cp`), divisors of the world size."""
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    local_rank = int(os.environ.get("LOCAL_RANK", 0)) if launched else 0
    world_env = int(os.environ["WORLD_SIZE"]) if launched else 1
    if ep < 1 or world_env % ep:
        raise ValueError(f"`parallel.ep` = {ep} must divide the world size {world_env} (EP borrows data-parallel ranks)")
    if cp < 1 or world_env % cp:
        raise ValueError(f"`parallel.cp` = {cp} must divide the world size {world_env} (CP borrows data-parallel ranks)")
    dev = resolve_device(device, local_rank)
    # CUDA runs also get gloo for the CPU-side collectives that DCP and object gathers use.
    backend = "cuda:nccl,cpu:gloo" if dev.type == "cuda" else "gloo"
    if not dist.is_initialized():
        if launched:
            start_rank_watchdog()  # before the first collective: joining the group already waits on the peers
            dist.init_process_group(backend, device_id=dev if dev.type == "cuda" else None)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    world = dist.get_world_size()
    mesh = init_device_mesh(dev.type, (world,), mesh_dim_names=(DP_SHARD,))
    _ROOT_MESHES.append(mesh)
    expert_mesh = mesh._unflatten(0, (world // ep, ep), (EFSDP, EP)) if ep > 1 else None
    context_mesh = mesh._unflatten(0, (world // cp, cp), (DP, CP)) if cp > 1 else None
    return ParallelDims(rank=dist.get_rank(), world_size=world, local_rank=local_rank, device=dev, mesh=mesh,
                        expert_mesh=expert_mesh, context_mesh=context_mesh)


def close_parallel(wait_for_peers: bool = False) -> None:
    """Tear the process group down, its backends' threads and connections with it, while the interpreter is whole
    (in-process callers such as tests may open another).

    `wait_for_peers`: on a normal end, meet every rank in a barrier first, so no rank closes its gloo
    connections while a peer still drains traffic on them. Not on an error path: a dead peer would never arrive.

    Destroying the group is not enough to end its backend: torch's DTensor caches (sharding propagation, mesh
    topology) keep the device meshes after the model is gone, and a world mesh keeps every group of its axes in
    its registry. gloo's worker and socket threads then live on into interpreter teardown, where a rank could
    abort after its last step ("terminate called without an active exception", a C++ thread torn down unjoined).
    Emptying the registries of the meshes built here leaves the groups to their other holders, a model's FSDP state
    in reference cycles: collected by the process's entry point once its command returns (`tandem.cli`), their
    destructors join those threads and close the connections before the interpreter's teardown begins. Not
    collected here, where the caller's model is still alive (and a collection costs a test that closes its ranks
    a fifth of a second)."""
    if not dist.is_initialized():
        return
    if wait_for_peers and dist.get_world_size() > 1:
        dist.barrier()
    dist.destroy_process_group()
    while _ROOT_MESHES:
        getattr(_ROOT_MESHES.pop(), "_pg_registry", {}).clear()  # a torch whose meshes keep no registry: nothing held
