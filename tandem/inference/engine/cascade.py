"""Which sequences of a decode step share a prompt prefix, so that cascade attention reads it once for all of them
(`tandem.kernels.cascade_attention`; the torch path: `paged_attention.reference_cascade_attention`).

Prefix caching gives the n samples of a prompt the same leading block ids (`block_manager.py`): shared blocks are
full blocks, written before any sequence that shares them decodes, and only their leading run counts here (a group's
prefix is the blocks all its members hold at the same leading positions).

Grouping: rows sorted by block table put the tables that share a prefix next to each other; a walk over them grows
a group while the key reads it saves, (members - 1) x prefix tokens, do not shrink (a member that shares less than
the group would shorten the prefix of all), up to the most members a prefix program holds. A step takes the cascade
only if its groups save at least `min_saved_tokens` tokens of keys and values per layer: below that the two extra
launches per layer (the prefix's chunks and the merge) are expected to cost more than the bytes they spare
(`engine.cascade_min_saved_tokens` says how the default was estimated).

The plan is kept while the step's rows hold the very same block-table lists: the block manager only appends to a
table or replaces it (`step_inputs.py` relies on the same), and blocks appended during decode are a sequence's
own, so a steady decode batch plans once, and again only when a sequence joins, finishes or is preempted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.inference.engine.sequence import Sequence


@dataclass
class SharedPrefixes:
    """A decode step's groups, on the host, by batch row."""

    groups: list[list[int]]
    """Batch rows of each group's members; the first one's block table names the prefix's blocks."""
    prefix_tokens: list[int]
    """Tokens of each group's shared prefix (whole blocks, fewer than any member's context)."""
    row_prefix: list[int]
    """Each row's group's prefix tokens, 0 for a row outside every group."""

    @property
    def saved_tokens(self) -> int:
        """Tokens of keys and values per layer that a step reads fewer than plain decode."""
        return sum((len(rows) - 1) * prefix for rows, prefix in zip(self.groups, self.prefix_tokens))

    def transfer_parts(self, num_rows: int, num_slots: int, members: int) -> list[list[int]]:
        """The kernels' inputs as integer lists: row prefixes (padded to `num_rows` with 0), group prefixes (to
        `num_slots` with 0: an unused slot) and members (`num_slots` x `members`, -1 past a group's last)."""
        group_prefix = self.prefix_tokens + [0] * (num_slots - len(self.groups))
        table = [rows + [-1] * (members - len(rows)) for rows in self.groups]
        table += [[-1] * members] * (num_slots - len(self.groups))
        return [self.row_prefix + [0] * (num_rows - len(self.row_prefix)), group_prefix,
                [row for rows in table for row in rows]]


@dataclass
class CascadeMetadata:
    """A cascade step's groups as the kernels read them (`tandem.kernels.cascade_attention`'s layouts)."""

    row_prefix: torch.Tensor
    """[B] tokens of each row's shared prefix (0: none)."""
    group_prefix: torch.Tensor
    """[G] tokens of each group slot's prefix (0: an unused slot)."""
    group_members: torch.Tensor
    """[G, members] batch rows of each group (-1 past its last)."""
    plan: SharedPrefixes | None = None
    """The same on the host, for the torch path; None on the CUDA-graph path."""


def group_slots(num_rows: int) -> int:
    """Group slots of a CUDA graph of `num_rows` rows: each group holds two rows or more."""
    return max(1, num_rows // 2)


def shared_blocks(a: list[int], b: list[int], limit: int) -> int:
    """Leading blocks tables `a` and `b` share, at most `limit`: a bisection over the length of equal leading runs
    (slice comparisons, in C), exact whatever the tables hold."""
    lo, hi = 0, min(len(a), len(b), limit)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def find_shared_prefixes(tables: list[list[int]], contexts: list[int], block_size: int, members: int) -> SharedPrefixes:
    """The groups of rows whose `tables` share leading blocks (see the module docstring), at most `members` each;
    `contexts`: each row's context this step (a prefix stays shorter: the row's own part holds its query's key)."""
    limits = [(ctx - 1) // block_size if ctx > 0 else 0 for ctx in contexts]
    order = sorted(range(len(tables)), key=tables.__getitem__)
    groups: list[list[int]] = []
    prefix_tokens: list[int] = []
    row_prefix = [0] * len(tables)
    i = 0
    while i < len(order):
        first = order[i]
        rows, shared = [first], limits[first]
        i += 1
        while i < len(order) and len(rows) < members:
            common = min(shared, shared_blocks(tables[first], tables[order[i]], limits[order[i]]))
            if common == 0 or len(rows) * common < (len(rows) - 1) * shared:
                break
            rows.append(order[i])
            shared = common
            i += 1
        if len(rows) > 1:
            groups.append(rows)
            prefix_tokens.append(shared * block_size)
            for row in rows:
                row_prefix[row] = shared * block_size
    return SharedPrefixes(groups, prefix_tokens, row_prefix)


class CascadePlanner:
    def __init__(self, block_size: int, members: int, min_saved_tokens: int):
        """`members`: most sequences per group (`tandem.kernels.cascade_attention.members_per_group`);
        `min_saved_tokens`: `engine.cascade_min_saved_tokens`."""
        self.block_size = block_size
        self.members = members
        self.min_saved_tokens = min_saved_tokens
        self._tables: list[list[int]] = []
        self._plan: SharedPrefixes | None = None

    def plan(self, seqs: list[Sequence]) -> SharedPrefixes | None:
        """The groups of a decode-only step of `seqs`, or None where the cascade would not pay."""
        tables = [seq.block_table for seq in seqs]
        if len(tables) != len(self._tables) or any(a is not b for a, b in zip(tables, self._tables)):
            self._tables = tables
            found = find_shared_prefixes(tables, [seq.num_computed_tokens + 1 for seq in seqs], self.block_size,
                                         self.members)
            self._plan = found if found.groups and found.saved_tokens >= self.min_saved_tokens else None
        return self._plan
