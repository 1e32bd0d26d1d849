"""This rank's micro-batches of a step: one per packed row, or its context-parallel shard of each."""

from __future__ import annotations

from tandem.trainer.micro_batch import MicroBatch
from tandem.trainer.parallel.context_parallel import gather_group_rows, shard_micro_batch
from tandem.trainer.parallel.dims import ParallelDims
from tandem.transport.types import PackedRow


def prepare_micro_batches(rows: list[PackedRow], dims: ParallelDims, policy_version: int | None = None,
                          router_replay: bool = False) -> list[MicroBatch]:
    """This rank's micro-batches: one per row, or under context parallelism this rank's shard of
    every row its `cp` group holds (all ranks of a group train the same rows)."""
    if dims.cp_size == 1:
        return [MicroBatch.from_row(row, dims.device, policy_version, router_replay) for row in rows]
    group = dims.cp_mesh.get_group()
    return [shard_micro_batch(MicroBatch.from_row(row, dims.device, policy_version, router_replay), group)
            for row in gather_group_rows(rows, group)]
