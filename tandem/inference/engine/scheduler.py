"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every step is one mixed batch under a token budget (`max_num_batched_tokens`) and a sequence cap
(`max_num_seqs`): first one token per decoding sequence, then the next chunk of each running
prefill, then waiting sequences in arrival order, each given blocks for all its tokens.

Admission control: a waiting sequence is admitted only when the blocks for all its tokens are
free; otherwise it (and everything behind it) waits, so memory pressure delays requests instead
of failing them. When a running sequence needs a new block and none is free, the most recently
admitted sequence is preempted (blocks freed, recomputed later from its tokens), never an error.

Speculative decoding (`num_lookahead_tokens` > 0): once every decode has its token and block, each decoding
sequence also gets budget and free blocks for up to that many drafted tokens (so drafts never preempt anyone);
the speculator then fills `drafts` with as many as it proposes, and the engine frees the blocks of the drafts
that were rejected.

Shared prefills: a sequence whose prompt has the same full blocks as an earlier one still
prefilling (the `n` samples of a request, the rollouts of a GRPO group sent as separate requests)
waits until that prefill is done, then takes those blocks from the prefix cache.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tandem.inference.engine.block_manager import BlockManager
from tandem.inference.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    """Tokens each sequence computes this step, from its `num_computed_tokens` on (its drafts included)."""
    num_lookahead: list[int] = field(default_factory=list)
    """Drafted tokens each sequence has room for (budget and blocks); 0 but for decoding sequences."""
    drafts: list[list[int]] = field(default_factory=list)
    """Drafted tokens each sequence computes after its last one (`set_drafts`); the policy's forward returns
    logits for its last token and each of them."""

    def add(self, seq: Sequence, num_new: int, num_lookahead: int = 0) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new)
        self.num_lookahead.append(num_lookahead)
        self.drafts.append([])

    def set_drafts(self, i: int, drafts: list[int]) -> None:
        assert len(drafts) <= self.num_lookahead[i], "more drafts than the sequence has room for"
        self.num_new_tokens[i] += len(drafts) - len(self.drafts[i])
        self.drafts[i] = drafts

    @property
    def has_drafts(self) -> bool:
        return any(self.drafts)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_decode_only(self) -> bool:
        """Every sequence computes one token: the step a CUDA graph can replay."""
        return all(n == 1 for n in self.num_new_tokens)

    @property
    def is_verify_only(self) -> bool:
        """Every sequence computes its last token and its drafts (if any): the step a verifying graph replays."""
        return all(n - len(d) == 1 and s.num_computed_tokens + 1 == s.num_tokens
                   for s, n, d in zip(self.seqs, self.num_new_tokens, self.drafts))

    def samples(self, i: int) -> bool:
        """Whether sequence i reaches its last token this step, so it samples the next one."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_new_tokens[i] - len(self.drafts[i]) == seq.num_tokens


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 num_lookahead_tokens: int = 0):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.num_lookahead_tokens = num_lookahead_tokens
        """Most drafted tokens per decoding sequence and step (speculative decoding; 0: off)."""
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefill_leaders: dict[tuple[bool, tuple[int, ...]], Sequence] = {}
        """(base model?, shareable prompt prefix) -> the sequence computing it; entries leave when their leader
        finishes. The base model's KV is never the policy's (`block_manager.chain_root`), so neither waits for the
        other."""

    def add(self, seq: Sequence) -> None:
        prefix = self._shareable_prefix(seq)
        if prefix[1]:
            leader = self.prefill_leaders.get(prefix)
            if leader is not None and not (leader.has_prefilled_prompt or leader.is_finished):
                seq.prefix_parent = leader
            else:
                self.prefill_leaders[prefix] = seq
        self.waiting.append(seq)

    def _shareable_prefix(self, seq: Sequence) -> tuple[bool, tuple[int, ...]]:
        """The prompt's full blocks before the one holding its last token (what the cache can share), and whose."""
        bs = self.block_manager.block_size
        return seq.is_base, tuple(seq.token_ids[:(seq.num_prompt_tokens - 1) // bs * bs])

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, lookahead: bool = True) -> ScheduledBatch:
        """The next step; `lookahead`: room for drafts too (where `num_lookahead_tokens` is set)."""
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        num_preemptions = self.num_preemptions
        # Decodes first (one token each), then prefill chunks: a long prompt never stalls decoding.
        for decoding in (True, False):
            for seq in list(self.running):
                if budget == 0:
                    break
                if seq.status is not SequenceStatus.RUNNING or (seq.num_uncomputed_tokens == 1) != decoding:
                    continue
                if seq.num_uncomputed_tokens == 0:  # prefilled elsewhere: the step samples its first token as it is
                    continue
                if seq.last_token_in_flight:  # its last token is being sampled; reading it finishes the sequence
                    continue
                if not self._make_room(seq):
                    continue
                num_new = min(seq.num_uncomputed_tokens, budget)
                batch.add(seq, num_new)
                budget -= num_new
            if decoding and self.num_lookahead_tokens and lookahead:
                budget -= self._reserve_lookahead(batch, budget)
        if self.num_preemptions == num_preemptions:  # memory is short: admit nobody new this step
            self._admit(batch, budget)
        return batch

    def _make_room(self, seq: Sequence) -> bool:
        """Get `seq` the block it needs, preempting later sequences; False if `seq` itself went."""
        bm = self.block_manager
        while not bm.can_append(seq):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        bm.append_blocks(seq)
        return True

    def _reserve_lookahead(self, batch: ScheduledBatch, budget: int) -> int:
        """Room for drafts after each decoding sequence's token, once every decode has its own block (so drafts
        never cost a preemption): within the budget, before `max_tokens` (a step emits at most one token more
        than it drafts), in free blocks only. Returns the budget it took."""
        taken = 0
        for i, seq in enumerate(batch.seqs):
            room_before_max_tokens = seq.params.max_tokens - seq.num_completion_tokens - 1
            wanted = min(self.num_lookahead_tokens, budget - taken, room_before_max_tokens)
            if wanted > 0:
                batch.num_lookahead[i] = self.block_manager.append_lookahead_blocks(seq, wanted)
                taken += batch.num_lookahead[i]
        return taken

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        kept: deque[Sequence] = deque()
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting.popleft()
            parent = seq.prefix_parent
            if parent is not None and not (parent.has_prefilled_prompt or parent.is_finished):
                kept.append(seq)  # an earlier sequence is computing the shared prefix: wait, then reuse it
                continue
            if not self.block_manager.can_allocate(seq):
                self.waiting.appendleft(seq)
                break
            seq.prefix_parent = None
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            num_new = min(seq.num_uncomputed_tokens, budget)
            batch.add(seq, num_new)
            budget -= num_new
        self.waiting.extendleft(reversed(kept))

    def add_running(self, seq: Sequence) -> None:
        """Run a sequence whose blocks another engine computed and the caller wrote (prefill/decode disaggregation):
        it joins the running ones at once, holding every token of its prompt computed."""
        assert seq.block_table and seq.num_uncomputed_tokens == 0, "add_running() before the blocks are written"
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free_blocks(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take a sequence out of the engine (finished or aborted) and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free_blocks(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.num_pending = 0  # a token sampled after the end is dropped
        prefix = self._shareable_prefix(seq)
        if self.prefill_leaders.get(prefix) is seq:
            del self.prefill_leaders[prefix]
