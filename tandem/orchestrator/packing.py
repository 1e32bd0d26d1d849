"""Packing samples into the trainer's rows, first-fit-decreasing, balanced over ranks.

Invariants of `pack_step` (tested): no row is longer than `seq_len`; every token of every
(possibly truncated) sample appears in exactly one row, with `position_ids` restarting at 0 where
its sample starts; every rank gets the same number of rows (short ranks get two-token padding
rows whose loss mask is 0); `num_loss_tokens` is the count over all ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tandem.orchestrator.samples import Sample
from tandem.transport.row_packing import first_fit_decreasing
from tandem.transport.types import PackedRow, TrainingBatch


@dataclass
class PackingStats:
    num_samples: int
    num_truncated: int
    """Samples longer than `seq_len`, cut to it (their tail is lost)."""
    num_rows: int
    num_padding_rows: int
    num_loss_tokens: int
    tokens_per_rank: list[int]


def truncate(sample: Sample, seq_len: int) -> bool:
    """Cut `sample` to `seq_len` tokens in place; True when it was longer."""
    if len(sample) <= seq_len:
        return False
    for name in ("token_ids", "loss_mask", "logprobs", "temperatures", "routed_experts"):
        setattr(sample, name, getattr(sample, name)[:seq_len])
    return True


def balance(loads: list[int], num_ranks: int) -> list[list[int]]:
    """Indices of `loads` split into `num_ranks` lists of at most ceil(n / num_ranks) items,
    heaviest first, each to the least loaded rank that still has room."""
    per_rank = max(1, math.ceil(len(loads) / num_ranks))
    ranks: list[list[int]] = [[] for _ in range(num_ranks)]
    totals = [0] * num_ranks
    for i in sorted(range(len(loads)), key=lambda i: -loads[i]):
        rank = min((r for r in range(num_ranks) if len(ranks[r]) < per_rank), key=lambda r: totals[r])
        ranks[rank].append(i)
        totals[rank] += loads[i]
    return ranks


def pack_step(step: int, samples: list[Sample], seq_len: int, num_ranks: int,
              pad_token_id: int) -> tuple[list[TrainingBatch], PackingStats]:
    """The batch of each trainer rank for `step`."""
    num_truncated = sum(truncate(s, seq_len) for s in samples)
    bins = first_fit_decreasing([len(s) for s in samples], seq_len)
    rows = [_row([samples[i] for i in b]) for b in bins]
    row_tokens = [len(r.input_ids) for r in rows]
    assignment = balance(row_tokens, num_ranks)
    per_rank = max(1, max(len(a) for a in assignment))  # an empty step still gives each rank one row
    num_loss_tokens = sum(s.num_loss_tokens for s in samples)
    batches = []
    for rank, row_ids in enumerate(assignment):
        rank_rows = [rows[i] for i in row_ids] + [_padding_row(pad_token_id) for _ in range(per_rank - len(row_ids))]
        versions = [samples[i].oldest_version for r in row_ids for i in bins[r]]
        batches.append(TrainingBatch(step=step, rank=rank, rows=rank_rows, num_loss_tokens=num_loss_tokens,
                                     policy_versions=versions))
    stats = PackingStats(
        num_samples=len(samples), num_truncated=num_truncated, num_rows=len(rows),
        num_padding_rows=per_rank * num_ranks - len(rows), num_loss_tokens=num_loss_tokens,
        tokens_per_rank=[sum(row_tokens[i] for i in a) for a in assignment],
    )
    return batches, stats


def _row(samples: list[Sample]) -> PackedRow:
    row = PackedRow(input_ids=[], position_ids=[], loss_mask=[], logprobs=[], advantages=[], temperatures=[],
                    policy_versions=[])
    replay = any(s.has_routed_experts for s in samples)
    for s in samples:
        row.input_ids.extend(s.token_ids)
        row.position_ids.extend(range(len(s)))
        row.loss_mask.extend(s.loss_mask)
        row.logprobs.extend(s.logprobs)
        row.advantages.extend(s.advantage * m for m in s.loss_mask)
        row.temperatures.extend(s.temperatures)
        row.policy_versions.extend([s.oldest_version] * len(s))
        if replay:
            row.routed_experts.extend(s.routed_experts)
    return row


def _padding_row(pad_token_id: int) -> PackedRow:
    # Two tokens: the trainer predicts token t from t-1, so a row needs at least two.
    return PackedRow(input_ids=[pad_token_id] * 2, position_ids=[0, 1], loss_mask=[0, 0], logprobs=[0.0, 0.0],
                     advantages=[0.0, 0.0], temperatures=[1.0, 1.0], policy_versions=[-1, -1])
