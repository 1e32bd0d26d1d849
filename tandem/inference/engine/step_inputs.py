"""A scheduled batch as device tensors, with one host-to-device copy per step.

Why: building a dozen small tensors from Python lists costs a blocking copy each; here every
integer the step needs (token ids, positions, slots, lengths, kernel tiles, sampled rows and
block-table changes) goes into one pinned host buffer, is copied in one go, and read on the
device as views.

A token the previous step sampled and the host has not read yet (see `sequence.py`) is sent as a
placeholder with the row of that step's sampled tokens to copy it from, on the device.

Block tables live on the device for the whole run ([max_num_seqs, blocks per max_model_len]),
one row per batch position. A row is rewritten only when another sequence takes the position or
its sequence gained blocks, so a steady decode batch sends a few entries per step, not whole
tables. Invariant: `_row_owner[i]` is the very `block_table` list whose first `_row_len[i]`
entries row i holds; the block manager only appends to a sequence's list and replaces it when
it frees blocks, so an owner that is still the same list has only gained entries. The host keeps
the same tables (`_host_tables`, written with the same updates), so the slots of a step of several
tokens a sequence are one array lookup for the whole batch, not a conversion and a few small array
operations per sequence.

A decode-only step with a cascade plan (`cascade.py`) sends its groups in the same copy.

A sequence with drafts (speculative decoding) computes its last token and its drafts, and every one
of those rows is sampled: the policy's next token after each. A verifying step a CUDA graph replays
(`build_verify`) has a fixed shape, k + 1 tokens for each of a padded number of sequences: the real
sequences' tokens come first, packed as in an eager step, and the tokens left over belong to one padding
sequence of context 0 (its attention reads nothing and writes zeros; its keys and values go to the pad slot).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tandem.inference.engine.cascade import CascadeMetadata, SharedPrefixes, group_slots
from tandem.inference.engine.scheduler import ScheduledBatch
from tandem.kernels.attention import query_tiles

PREFILL_BLOCK_Q = 16
"""Query tokens per attention tile in steps that prefill (decode-only steps use 1)."""

VIEW_ALIGNMENT = 2
"""Each view starts at a multiple of this many int64 elements (16 bytes) of the buffer. Triton compiles a kernel
once per alignment class of its pointers: packed end to end, a step with an odd number of sequences would move
the views after the first odd-sized one off 16 bytes, and kernels reading them (paged attention's lengths and
tiles) would compile again mid-run, the likely cause (inferred from where they fell, not traced) of the
second-long first prefill steps with an odd number of sequences in
`benchmarks/results/engine-h200-2026-12-04-unfused.json`."""


def aligned(size: int) -> int:
    return -(-size // VIEW_ALIGNMENT) * VIEW_ALIGNMENT


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    """[N] (or [bucket] for a padded decode step)"""
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    """[B] (or [bucket]: padding rows have context 0)"""
    query_start: torch.Tensor
    """[B + 1]"""
    tiles: torch.Tensor
    """[2, T]"""
    sample_index: torch.Tensor
    """[S] rows of the step's tokens whose logits are sampled, in batch order"""
    block_q: int
    query_lens: list[int]
    seq_lens_host: list[int]
    cascade: CascadeMetadata | None = None
    """A decode-only step's groups sharing a prompt prefix (group slots: `cascade.group_slots` of a padded batch)."""


def decode_tiles(num_seqs: int) -> list[list[int]]:
    return [list(range(num_seqs)), [0] * num_seqs]


class StepInputBuilder:
    def __init__(self, device: torch.device, max_num_seqs: int, max_blocks_per_seq: int, block_size: int, pad_slot: int):
        self.device = device
        self.block_size = block_size
        self.pad_slot = pad_slot
        self.block_tables = torch.zeros(max_num_seqs, max_blocks_per_seq, dtype=torch.long, device=device)
        self._width = max_blocks_per_seq
        self._row_owner: list[list[int] | None] = [None] * max_num_seqs
        self._row_len = [0] * max_num_seqs
        self._host_tables = np.zeros(max_num_seqs * max_blocks_per_seq, dtype=np.int64)
        """`block_tables`' rows as the host last wrote them, flat."""
        self._host = [torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long)]
        """Two staging buffers, taken in turn: filling one never waits for the other's copy."""
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self._device_buffer = torch.empty(0, dtype=torch.long, device=device)

    def _table_updates(self, batch: ScheduledBatch) -> tuple[list[int], list[int]]:
        """Flat indices into `block_tables` and the block ids to write there."""
        index: list[int] = []
        value: list[int] = []
        for i, seq in enumerate(batch.seqs):
            table = seq.block_table
            known = self._row_len[i] if self._row_owner[i] is table else 0
            if known == len(table):
                continue
            self._row_owner[i], self._row_len[i] = table, len(table)
            base = i * self._width
            index.extend(range(base + known, base + len(table)))
            value.extend(table[known:])
        if index:
            self._host_tables[index] = value
        return index, value

    def _positions_and_slots(self, starts: np.ndarray, query_start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each token's position and cache slot, for sequences whose new tokens start at positions `starts` [B]
        and are packed at `query_start` [B + 1]; after `_table_updates` of the step."""
        counts = np.diff(query_start)
        positions = np.arange(query_start[-1]) + np.repeat(starts - query_start[:-1], counts)
        rows = np.repeat(np.arange(len(starts)) * self._width, counts)
        return positions, self._host_tables[rows + positions // self.block_size] * self.block_size + positions % self.block_size

    def build(self, batch: ScheduledBatch, pad_to: int | None = None, previous_tokens: torch.Tensor | None = None,
              cascade: SharedPrefixes | None = None, members: int = 0) -> StepInputs:
        """The step's tensors; `pad_to`: a decode-only step padded to a CUDA graph's batch size.

        `previous_tokens`: the last launched step's sampled tokens (device), where pending input ids are.
        `cascade`: a decode-only step's groups, of at most `members` sequences each.
        """
        bs = self.block_size
        seqs, num_new = batch.seqs, batch.num_new_tokens
        decode_only = batch.is_decode_only
        # Input ids whose token is still pending, and the rows of `previous_tokens` that hold them.
        gather_at: list[int] = []
        gather_from: list[int] = []
        if decode_only:
            positions = [s.num_computed_tokens for s in seqs]
            ids = []
            for i, (s, p) in enumerate(zip(seqs, positions)):
                if p < len(s.token_ids):
                    ids.append(s.token_ids[p])
                else:
                    ids.append(0)
                    gather_at.append(i)
                    gather_from.append(s.pending_row)
            slots = [s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, positions)]
            seq_lens = [p + 1 for p in positions]
            query_lens = [1] * len(seqs)
            sample_index = list(range(len(seqs)))
            tiles = decode_tiles(len(seqs))
            if pad_to is not None:
                pad = pad_to - len(seqs)
                ids, positions, slots, seq_lens = ids + [0] * pad, positions + [0] * pad, slots + [self.pad_slot] * pad, seq_lens + [0] * pad
        else:
            assert pad_to is None, "only decode-only steps run as CUDA graphs"
            ids, seq_lens, sample_index = [], [], []
            query_lens = list(num_new)
            offset = 0
            for i, (seq, n, drafts) in enumerate(zip(seqs, num_new, batch.drafts)):
                start = seq.num_computed_tokens
                end = start + n
                ids += seq.token_ids[start:end]
                ids += drafts
                offset += n
                if len(ids) < offset:  # only the newest token can be pending: the one a decode computes
                    assert len(ids) == offset - 1, "an input token two steps old was never read"
                    ids.append(0)
                    gather_at.append(offset - 1)
                    gather_from.append(seq.pending_row)
                seq_lens.append(end)
                if batch.samples(i):
                    sample_index.extend(range(offset - 1 - len(drafts), offset))
            tiles = query_tiles(query_lens, PREFILL_BLOCK_Q)
        query_start = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start[1:])
        update_index, update_value = self._table_updates(batch)
        if not decode_only:
            starts = np.fromiter((s.num_computed_tokens for s in seqs), np.int64, len(seqs))
            positions, slots = self._positions_and_slots(starts, query_start)
        parts = [ids, positions, slots, seq_lens, query_start, tiles[0] + tiles[1], sample_index, update_index, update_value,
                 gather_at, gather_from]
        if cascade is not None:
            assert decode_only, "cascade attention serves decode-only steps"
            num_rows = len(seq_lens)
            parts += cascade.transfer_parts(num_rows, group_slots(num_rows) if pad_to else len(cascade.groups), members)
        views = self._transfer(parts)
        if update_index:
            self.block_tables.view(-1).index_copy_(0, views[7], views[8])
        if gather_at:
            assert previous_tokens is not None, "a pending input token needs the previous step's tokens"
            views[0].index_copy_(0, views[9], previous_tokens[views[10]])
        return StepInputs(
            input_ids=views[0], positions=views[1], slot_mapping=views[2], seq_lens=views[3], query_start=views[4],
            tiles=views[5].view(2, -1), sample_index=views[6], block_q=1 if decode_only else PREFILL_BLOCK_Q,
            query_lens=query_lens, seq_lens_host=seq_lens[:len(seqs)],
            cascade=None if cascade is None else CascadeMetadata(views[11], views[12], views[13].view(-1, members), cascade),
        )

    def build_verify(self, batch: ScheduledBatch, pad_to: int, tokens_per_seq: int, block_q: int) -> StepInputs:
        """A step of decoding sequences with drafts, as a verifying graph of `pad_to` sequences reads it: token
        rows [pad_to * tokens_per_seq], lengths [pad_to + 1] and query starts [pad_to + 2] (the real sequences,
        then the padding sequence), tiles [2, 2 * pad_to] of `block_q` tokens (unused ones start past their
        sequence's tokens, so they do nothing). Every input token is known to the host: a step that drafts was
        planned after the previous one was read."""
        b = len(batch.seqs)
        num_rows = pad_to * tokens_per_seq
        ids: list[int] = []
        starts: list[int] = []
        seq_lens: list[int] = []
        for seq, drafts in zip(batch.seqs, batch.drafts):
            start = seq.num_computed_tokens
            assert start == len(seq.token_ids) - 1, "a verifying step's sequences decode, their last token known"
            ids.append(seq.token_ids[start])
            ids += drafts
            starts.append(start)
            seq_lens.append(start + 1 + len(drafts))
        query_lens = list(batch.num_new_tokens)
        num_real = len(ids)
        pad = num_rows - num_real
        ids += [0] * pad
        query_start = np.zeros(pad_to + 2, dtype=np.int64)
        np.cumsum(query_lens, out=query_start[1:b + 1])
        update_index, update_value = self._table_updates(batch)
        positions, slots = self._positions_and_slots(np.asarray(starts, dtype=np.int64), query_start[:b + 1])
        positions = np.concatenate([positions, np.zeros(pad, dtype=np.int64)])
        slots = np.concatenate([slots, np.full(pad, self.pad_slot, dtype=np.int64)])
        query_start[b + 1:] = num_rows  # the padding sequence owns the rest; those after it, nothing
        padding_tiles = -(-pad // block_q)
        unused = 2 * pad_to - b - padding_tiles
        tile_seqs = list(range(b)) + [b] * (padding_tiles + unused)
        tile_starts = [0] * b + list(range(0, padding_tiles * block_q, block_q)) + [num_rows] * unused
        views = self._transfer([ids, positions, slots, seq_lens + [0] * (pad_to + 1 - b), query_start,
                                tile_seqs + tile_starts, list(range(num_real)), update_index, update_value])
        if update_index:
            self.block_tables.view(-1).index_copy_(0, views[7], views[8])
        return StepInputs(
            input_ids=views[0], positions=views[1], slot_mapping=views[2], seq_lens=views[3], query_start=views[4],
            tiles=views[5].view(2, -1), sample_index=views[6], block_q=block_q, query_lens=query_lens,
            seq_lens_host=seq_lens,
        )

    def _transfer(self, parts: list) -> list[torch.Tensor]:
        """Pack the integer lists into one host buffer, copy it to the device once, return views."""
        sizes = [len(p) for p in parts]
        total = sum(aligned(size) for size in sizes)
        turn = self._turn
        self._turn ^= 1
        copied = self._copied[turn]
        if copied is not None:
            copied.synchronize()  # the step before last may still be copying from this buffer
        if total > self._host[turn].numel():
            capacity = max(total, 2 * self._host[turn].numel(), 4096)
            self._host[turn] = torch.empty(capacity, dtype=torch.long, pin_memory=self.device.type == "cuda")
            if self.device.type == "cuda" and capacity > self._device_buffer.numel():
                self._device_buffer = torch.empty(capacity, dtype=torch.long, device=self.device)
        staging = self._host[turn]
        host = staging.numpy()
        offset = 0
        for part, size in zip(parts, sizes):
            host[offset:offset + size] = part
            offset += aligned(size)
        if self.device.type == "cuda":
            # One device buffer serves every step: the stream runs a step's copy after the previous step's kernels.
            buffer = self._device_buffer
            buffer[:total].copy_(staging[:total], non_blocking=True)
            self._copied[turn] = torch.cuda.Event()
            self._copied[turn].record()
        else:
            buffer = staging[:total].clone()  # a later step reuses the host buffer
        views, offset = [], 0
        for size in sizes:
            views.append(buffer[offset:offset + size])
            offset += aligned(size)
        return views
