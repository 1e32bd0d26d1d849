"""Paged KV-cache blocks: allocation, reference counts and prefix caching.

Plain Python, no tensors: the block manager only decides which block ids a sequence owns.

Prefix caching: a full block whose KV has been computed is registered under a chained hash of
all tokens up to its end. A later sequence whose prompt starts with the same tokens shares the
block (reference count + 1) instead of recomputing it; this is how the `n` samples of a request
share the prompt's prefill, and how the next turn of a conversation reuses the previous one.
Invariants:
- a block is registered only after its KV is written, and only while the weights that wrote it
  are live (`cache_epoch`): a weight update starts a new epoch and forgets every registration;
- shared blocks are full and never written again; the block holding a sequence's last prompt
  token is never taken from the cache, so every sequence computes at least one token;
- a block's hash chain starts from the model that computed its KV (`chain_root`): the base model served beside a
  LoRA policy never shares blocks with the policy, though their tokens are the same;
- a freed block keeps its registration until it is reused, so a finished sequence's prefix can
  still be hit; free blocks are reused oldest first.
"""

from __future__ import annotations

from collections import OrderedDict

from tandem.inference.engine.sequence import Sequence


def chain_hash(parent: int | None, tokens: list[int]) -> int:
    return hash((parent, tuple(tokens)))


BASE_CHAIN_ROOT = chain_hash(None, [-1])
"""Where the hash chain of a base sequence's blocks starts (no token id is -1, so no policy chain passes by it)."""


def chain_root(seq: Sequence) -> int | None:
    """The parent hash of a sequence's first block: None for the policy's, `BASE_CHAIN_ROOT` for the base model's."""
    return BASE_CHAIN_ROOT if seq.is_base else None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}
        """Chained hash -> block id of computed blocks of the current epoch."""
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cache_epoch = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences."""
        return 1.0 - len(self.free) / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: Sequence) -> bool:
        # Conservative: cache hits would need fewer free blocks.
        return self.num_blocks_for(seq.num_tokens) <= len(self.free)

    def allocate(self, seq: Sequence) -> None:
        """Give a waiting sequence blocks for all its tokens, reusing cached leading blocks."""
        assert not seq.block_table, "allocate() on a sequence that already holds blocks"
        assert not seq.num_pending, "allocate() before the host read the sequence's last token"
        seq.cache_epoch = self.cache_epoch
        seq.block_hashes = []
        for h, block in self._cached_prefix(seq.token_ids[:seq.num_tokens - 1], chain_root(seq)):
            if self.ref_counts[block] == 0:
                del self.free[block]
            self.ref_counts[block] += 1
            seq.block_table.append(block)
            seq.block_hashes.append(h)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        for _ in range(self.num_blocks_for(seq.num_tokens) - len(seq.block_table)):
            seq.block_table.append(self._take_free_block())

    def _cached_prefix(self, token_ids: list[int], root: int | None = None) -> list[tuple[int, int]]:
        """(chained hash, block id) of the leading full blocks of `token_ids` that the cache holds, the chain
        starting at `root` (`chain_root`)."""
        bs = self.block_size
        found: list[tuple[int, int]] = []
        parent = root
        for i in range(len(token_ids) // bs):
            h = chain_hash(parent, token_ids[i * bs:(i + 1) * bs])
            block = self.cached.get(h)
            if block is None:
                break
            found.append((h, block))
            parent = h
        return found

    def num_cached_blocks(self, prompt_token_ids: list[int]) -> int:
        """Leading blocks of a policy prompt that `allocate` would take from the cache now. Plain lookups, so another
        thread may ask (a decode server choosing where to prefill): the answer may be a step stale."""
        return len(self._cached_prefix(prompt_token_ids[:len(prompt_token_ids) - 1]))

    def _take_free_block(self) -> int:
        block, _ = self.free.popitem(last=False)
        old = self.block_hash[block]
        if old is not None:
            if self.cached.get(old) == block:
                del self.cached[old]
            self.block_hash[block] = None
        self.ref_counts[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free[block] = None

    def free_blocks(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []
        seq.block_hashes = []

    def num_missing_blocks(self, seq: Sequence) -> int:
        """Blocks a running sequence lacks to hold all its tokens (0, or 1 after a sampled token)."""
        return self.num_blocks_for(seq.num_tokens) - len(seq.block_table)

    def can_append(self, seq: Sequence) -> bool:
        return self.num_missing_blocks(seq) <= len(self.free)

    def append_blocks(self, seq: Sequence) -> None:
        for _ in range(self.num_missing_blocks(seq)):
            seq.block_table.append(self._take_free_block())

    def append_lookahead_blocks(self, seq: Sequence, num_lookahead: int) -> int:
        """Blocks from the free list for up to `num_lookahead` slots past the sequence's tokens (drafts); returns
        how many slots it has room for."""
        room = len(seq.block_table) * self.block_size - seq.num_tokens
        while room < num_lookahead and self.free:
            seq.block_table.append(self._take_free_block())
            room += self.block_size
        return min(room, num_lookahead)

    def free_lookahead_blocks(self, seq: Sequence) -> None:
        """Give back the blocks past the sequence's tokens (the slots of rejected drafts): they were taken fresh
        and never registered, and their keys and values are overwritten before they are read. The table becomes
        a new list, as when all blocks are freed: lists only grow in place (`step_inputs.py` relies on it)."""
        needed = self.num_blocks_for(seq.num_tokens)
        if len(seq.block_table) > needed:
            for block in seq.block_table[needed:]:
                self._release(block)
            seq.block_table = seq.block_table[:needed]

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Make the sequence's newly computed full blocks whose tokens the host knows available to later sequences."""
        if seq.cache_epoch != self.cache_epoch:
            return
        bs = self.block_size
        num_full = min(seq.num_computed_tokens, len(seq.token_ids)) // bs
        for i in range(len(seq.block_hashes), num_full):
            parent = seq.block_hashes[-1] if seq.block_hashes else chain_root(seq)
            h = chain_hash(parent, seq.token_ids[i * bs:(i + 1) * bs])
            seq.block_hashes.append(h)
            block = seq.block_table[i]
            if h not in self.cached and self.block_hash[block] is None:
                self.cached[h] = block
                self.block_hash[block] = h

    def reset_prefix_cache(self) -> None:
        """Forget every registration (after a weight update: cached KV belongs to old weights)."""
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        self.cache_epoch += 1
