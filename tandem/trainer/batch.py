"""`MicroBatch`: one packed row as device tensors, the unit of one forward/backward pass.

RL rows come from the orchestrator's `PackedRow`s; SFT builds `PackedRow`s too (zero inference
logprobs and advantages, temperature 1), so both trainers share the conversion and the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.models.attention import document_lengths
from tandem.trainer.parallel.context_parallel import ContextShard, gather_group_rows, shard_micro_batch
from tandem.trainer.parallel.dims import ParallelDims
from tandem.transport.types import PackedRow


def replay_tensor(row: PackedRow, device: torch.device) -> torch.Tensor | None:
    """The row's routed experts as [T, L, k] (-1 where not given); None where it has none (`data.check_batch`
    refuses rows with loss tokens and without them under router replay)."""
    given = next((r for r in row.routed_experts if r), None)
    if given is None:
        return None
    shape = (len(given), len(given[0]))
    return torch.tensor([r or [[-1] * shape[1]] * shape[0] for r in row.routed_experts]).to(device, non_blocking=True)


@dataclass
class MicroBatch:
    """All tensors [1, T]; a context-parallel shard's [1, T_local] (see `context`)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    """Bool."""
    inference_logprobs: torch.Tensor
    advantages: torch.Tensor
    temperatures: torch.Tensor
    on_policy: torch.Tensor
    """Bool: tokens sampled by the policy the trainer holds now (all, when versions are unknown)."""
    row_document_lengths: list[list[int]] | None
    """Host-side lengths of the documents packed in the row, for attention without a mask or a sync
    (None for a context-parallel shard: its documents are in `context`)."""
    routed_experts: torch.Tensor | None = None
    """Router replay: [T, num_moe_layers, k] expert ids per token, rows of -1 where the model routes itself."""
    predicting_positions: torch.Tensor | None = None
    """[N] long: the positions whose next token is a loss token (position 0 alone when the row has none),
    taken from the host's copy of the loss mask, so that the model selects them without a device sync
    (`PolicyModel.forward`); None: the model finds them on the device (a context-parallel shard)."""
    context: ContextShard | None = None
    """Context parallelism: where this shard's tokens sit in the row. The loss fields (loss mask,
    logprobs, advantages, temperatures, on_policy) are then already shifted onto the position that
    predicts their token; None: a whole row, token t predicted at t - 1."""

    @classmethod
    def from_row(cls, row: PackedRow, device: torch.device, policy_version: int | None = None,
                 router_replay: bool = False) -> "MicroBatch":
        """`policy_version`: the version of the weights being trained (step N trains N-1); `router_replay`:
        keep the row's routed experts."""
        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype).unsqueeze(0).to(device, non_blocking=True)

        routed = replay_tensor(row, device) if router_replay else None

        return cls(
            input_ids=tensor(row.input_ids, torch.long),
            position_ids=tensor(row.position_ids, torch.long),
            loss_mask=tensor(row.loss_mask, torch.bool),
            inference_logprobs=tensor(row.logprobs, torch.float32),
            advantages=tensor(row.advantages, torch.float32),
            temperatures=tensor(row.temperatures, torch.float32),
            on_policy=(tensor(row.policy_versions, torch.long) == policy_version)
            if row.policy_versions and policy_version is not None else tensor([True] * len(row.input_ids), torch.bool),
            row_document_lengths=[document_lengths(row.position_ids)],
            routed_experts=routed,
            predicting_positions=tensor([t for t, m in enumerate(row.loss_mask[1:]) if m] or [0], torch.long)[0],
        )

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()


def prepare_micro_batches(rows: list[PackedRow], dims: ParallelDims, policy_version: int | None = None,
                          router_replay: bool = False) -> list[MicroBatch]:
    """This rank's micro-batches: one per row, or under context parallelism this rank's shard of
    every row its `cp` group holds (all ranks of a group train the same rows)."""
    if dims.cp_size == 1:
        return [MicroBatch.from_row(row, dims.device, policy_version, router_replay) for row in rows]
    group = dims.cp_mesh.get_group()
    return [shard_micro_batch(MicroBatch.from_row(row, dims.device, policy_version, router_replay), group)
            for row in gather_group_rows(rows, group)]
