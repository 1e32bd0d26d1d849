"""`MicroBatch`: one packed row as device tensors, the unit of one forward/backward pass, and `ContextShard`,
where a context-parallel shard's tokens sit in their row.

RL rows come from the orchestrator's `PackedRow`s; SFT builds `PackedRow`s too (zero inference
logprobs and advantages, temperature 1), so both trainers share the conversion and the step.
These types stand apart from both producers (`batch.prepare_micro_batches`) and the context-parallel
code that shards them (`parallel.context_parallel`), which both import them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from tandem.models.attention import document_lengths
from tandem.transport.types import PackedRow


@dataclass
class ContextShard:
    """Where this rank's tokens sit in their row, and which document each token of the row is in."""

    group: dist.ProcessGroup
    """The `cp` group: ranks holding the other shards of the same rows."""
    size: int
    rank: int
    """This rank's index in the group (its shard)."""
    row_document_ids: torch.Tensor
    """[T_padded] document index of every token of the whole (padded) row."""
    row_document_lengths: list[int]
    """Host-side lengths of the documents of the padded row (the padding last)."""
    targets: torch.Tensor
    """[1, T_local] the token each local position predicts (the row's next token)."""
    num_real: int
    """Tokens of the row before its padding."""

    def token_index(self, cp_rank: int) -> torch.Tensor:
        """Global indices in the padded row of the tokens shard `cp_rank` holds."""
        return zigzag_indices(self.row_document_ids.numel(), self.size, cp_rank, self.row_document_ids.device)

    def real_tokens(self) -> torch.Tensor:
        """[T_local] bool: which of this rank's tokens are the row's, not its padding."""
        return self.token_index(self.rank) < self.num_real


def zigzag_indices(length: int, cp_size: int, cp_rank: int, device: torch.device | None = None) -> torch.Tensor:
    """Indices of chunks `cp_rank` and `2 cp_size - 1 - cp_rank` of a row of `length` (a multiple of 2 cp_size)."""
    chunk = length // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    last_start = (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([first, torch.arange(last_start, last_start + chunk, device=device)])


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
