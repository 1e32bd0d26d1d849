"""Speculative decoding: drafts proposed, verified by the policy in one forward, accepted so that the emitted
tokens follow the policy's own sampling distribution.

A decoding sequence with drafts d1..dd computes its last token and its drafts in one forward (the paged cache
writes all their keys and values); logit row j is the policy's distribution of the token after row j's input.
Acceptance, per sequence:
- deterministic drafts (n-gram, a greedy draft model, and every greedy request): the policy samples each row as
  the sampler would at that position (same temperature and filters; a seeded sequence's noise of row j is its
  generator's next draw). Draft j + 1 is accepted when row j's sample equals it; the first mismatch, or row d
  when all are accepted, gives the policy's own token, and the generator is set back to where as many draws as
  emitted tokens leave it. The emitted tokens are then those the policy samples without speculation: the same
  seed gives the same tokens with speculation on or off.
- sampled drafts (a draft model drawing at the request's temperature from q): draft j + 1 is accepted with
  probability min(1, p/q), else the row draws from max(0, p - q) normalized and the sequence stops there
  (rejection sampling, Leviathan et al. and Chen et al. 2023): each emitted token is distributed as p.
Every emitted token reports the policy's logprob from the verifying forward, log_softmax(logits / T) before the
filters, as the sampler does; the accepted drafts' keys and values stay, the rejected ones' slots are
overwritten by later tokens or their blocks freed (`BlockManager.free_lookahead_blocks`).

The draft model keeps a paged cache of its own, indexed by the policy's block ids: it runs every batch the policy
runs, so wherever the policy's cache holds a token, the draft's holds its own keys and values of that token.
Drafting then needs no block manager of its own: draft step j decodes each drafting sequence's token at its last
position + j (its last token, then its drafts) into the slots the scheduler reserved for the drafts.

In exact mode (`[run] exact`, `tandem.models.exact`) every token is attended as a decode query of its own and
every row of the head and of log_softmax is computed alike whatever rows stand beside it, so a verifying row's
logits and logprobs are bitwise those of the decode step that computes its token without drafts, and the
trainer's: deterministic drafts then give bitwise the tokens and logprobs of exact mode without speculation. The
draft model keeps the engine's ordinary path: its drafts decide which rows the policy computes, never a logprob.

The multi-token prediction layer of GLM-5 and DeepSeek-V3 checkpoints, or a decoder family's draft head, drafts from
the policy's own hidden states (`MtpProposer`): its entries live beside the policy's in the same paged cache (latent
entries, or keys and values), written as the policy runs.

On a decode server (prefill/decode disaggregation) a prompt prefilled elsewhere samples its first token from the
handed logits row in the step that takes it over, as a sequence with no drafts after the batch's own (one row of
`verify`'s); the proposer then drafts for it from what it was handed (`Proposer.take_over`, given the prefill
server's `Proposer.handed_state`), as if this engine had computed the prompt.

A step drafts only where the proposer judges it worth it (`Proposer.worth_drafting`; n-gram drafts from how
often prompt lookup would have guessed each sequence's recent tokens), else it is a plain decode step. With CUDA
graphs, a step whose sequences all decode replays a verifying graph of k + 1 tokens a sequence
(`model_runner.py`); one that also prefills runs eager.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from tandem.inference.engine.host_copies import HostRead, to_device
from tandem.inference.engine.model_runner import PagedModelRunner, step_metadata
from tandem.inference.engine.sampler import SampleResult, Sampler, filter_logprobs, race
from tandem.inference.engine.scheduler import ScheduledBatch
from tandem.inference.engine.sequence import Sequence
from tandem.inference.engine.step_inputs import StepInputBuilder


class NgramIndex:
    """One sequence's tokens indexed for prompt lookup, grown as the sequence grows: the drafts are the tokens that
    followed the latest earlier occurrence of the longest suffix (`ngram_max` tokens down to 1) of the sequence.

    Why an index: looking the last token up among its earlier places costs what those places cost, not a pass
    over the whole context every step. The places of a token are chained from its latest (`latest`, then
    `previous` at each place), so indexing a token allocates no container the garbage collector would scan. Only
    the latest `MAX_PLACES` places are tried (a frequent token's older places are older contexts). The index also
    keeps `hit_rate`: how often, over the sequence's recent tokens, the first draft would have been the token that
    came, which says whether drafting for it pays.

    Drafts being verified can be indexed ahead (`extend_ahead`), while the device computes the verifying step:
    the lookups that score them then run before the host waits for it, not after. `extend` keeps those that came
    and takes the others back with their scores, so the index and its hit rate are those of indexing only the
    tokens that came."""

    MAX_PLACES = 64
    HIT_RATE_TOKENS = 16
    """The hit rate is a moving average over about this many tokens (each new one weighs 1/16)."""

    def __init__(self, ngram_max: int):
        self.ngram_max = ngram_max
        self.tokens: list[int] = []
        self.latest: dict[int, int] = {}
        """Token id -> its latest position before the last token's."""
        self.previous: list[int] = []
        """Per position p before the last token's: the position of the same token before p, or -1."""
        self.hit_rate = 0.0
        self._ahead: list[float] = []
        """Per token indexed ahead (the last ones of `tokens`), the hit rate before it was scored."""
        self._first_drafts: dict[int, int] = {}
        """First drafts looked up (-1: none) by the number of tokens they follow, kept for the scoring that needs them
        (a step's drafts, those indexed ahead) until `extend` catches up."""

    @property
    def num_settled(self) -> int:
        """Tokens indexed, those indexed ahead left out."""
        return len(self.tokens) - len(self._ahead)

    def extend(self, token_ids: list[int]) -> None:
        """Catch up with `token_ids` (the sequence's tokens, which only grow), keeping the tokens indexed ahead that
        came. Only the last `HIT_RATE_TOKENS` * 4 of a long stretch (a prompt) are scored: older ones would weigh
        nothing in the average."""
        if self._ahead:
            self._settle(token_ids)
        first_scored = len(token_ids) - 4 * self.HIT_RATE_TOKENS
        self._append_tokens(token_ids, len(self.tokens), None, first_scored)
        self._first_drafts.clear()

    def extend_ahead(self, drafts: list[int]) -> None:
        """Index `drafts`, each scored as if it came, and look up the first draft after them (what the token that
        follows them is scored with), before the step that verifies them is read."""
        self._append_tokens(drafts, 0, self._ahead, 0)
        if self.tokens[-1] in self.latest:
            self.drafts(1)  # kept for scoring the token after them

    def _append_tokens(self, new: list[int], start: int, rates_before: list[float] | None, first_scored: int) -> None:
        """Append `new[start:]`, scoring those at positions from `first_scored` on (where a token precedes them);
        `rates_before`: where to keep the hit rate before each. One loop, the method calls left out: it runs for
        every token of every sequence."""
        tokens, latest, previous, first_drafts = self.tokens, self.latest, self.previous, self._first_drafts
        for token in new[start:] if start else new:
            length = len(tokens)
            if not length:
                tokens.append(token)
                continue
            before = tokens[-1]  # now an earlier occurrence
            if length >= first_scored:
                if rates_before is not None:
                    rates_before.append(self.hit_rate)
                guess = first_drafts.get(length)
                if guess is None:
                    # Lookup guesses nothing after a token not seen before (most tokens of text that does not
                    # repeat): a miss, scored without the lookup.
                    found = self.drafts(1) if before in latest else None
                    guess = found[0] if found else -1
                self.hit_rate += ((1.0 if guess == token else 0.0) - self.hit_rate) / self.HIT_RATE_TOKENS
            previous.append(latest.get(before, -1))
            latest[before] = length - 1
            tokens.append(token)

    def _settle(self, token_ids: list[int]) -> None:
        """Keep the tokens indexed ahead that `token_ids` holds at their places; take back the others, their
        scores and the first drafts looked up after them. All are taken back where `extend` would leave the first
        of them unscored (many tokens came since)."""
        start = self.num_settled
        kept = 0
        if start >= len(token_ids) - 4 * self.HIT_RATE_TOKENS:
            while (kept < len(self._ahead) and start + kept < len(token_ids)
                   and token_ids[start + kept] == self.tokens[start + kept]):
                kept += 1
        if kept < len(self._ahead):
            self.hit_rate = self._ahead[kept]
            for length in range(len(self.tokens), start + kept, -1):
                self._first_drafts.pop(length, None)
                self._pop()
        self._ahead.clear()

    def _pop(self) -> None:
        """Take back the last token `_append_tokens` appended."""
        self.tokens.pop()
        before = self.tokens[-1]
        earlier = self.previous.pop()
        if earlier < 0:
            del self.latest[before]
        else:
            self.latest[before] = earlier

    def drafts(self, num_drafts: int) -> list[int]:
        """At most `num_drafts` tokens after the latest earlier occurrence of the longest suffix; none without one."""
        tokens = self.tokens
        last = len(tokens) - 1
        end = self.latest.get(tokens[last], -1) if last > 0 else -1
        if end < 0:
            self._first_drafts[len(tokens)] = -1
            return []
        longest = min(self.ngram_max, last)
        best, best_length = -1, 0
        for _ in range(self.MAX_PLACES):
            length = 1
            while length < longest and end >= length and tokens[end - length] == tokens[last - length]:
                length += 1
            if length > best_length:
                best, best_length = end, length
                if length == longest:
                    break
            end = self.previous[end]
            if end < 0:
                break
        self._first_drafts[len(tokens)] = tokens[best + 1]
        return tokens[best + 1:best + 1 + num_drafts]



def expected_accepted(hit_rates: np.ndarray, num_drafts: int) -> np.ndarray:
    """Accepted drafts to expect of `num_drafts` for each hit rate h (each draft right as often as the recent first
    drafts were): h + h^2 + ... + h^num_drafts."""
    return sum(hit_rates ** j for j in range(1, num_drafts + 1))


def steps_that_cannot_draft(hit_rates: np.ndarray, num_drafts: int, min_expected_tokens: float, most: int) -> int:
    """How many steps (at most `most`) the decoding sequences of these hit rates certainly stay below
    `min_expected_tokens` accepted drafts each on average: even if each step's new token of every sequence were a
    hit, each raising its rate h to h + (1 - h) / `NgramIndex.HIT_RATE_TOKENS`."""
    steps = np.arange(1, most + 1)[:, None]
    best = 1 - (1 - hit_rates[None, :]) * (1 - 1 / NgramIndex.HIT_RATE_TOKENS) ** steps
    reaches = expected_accepted(best, num_drafts).mean(axis=1) >= min_expected_tokens
    return int(reaches.argmax()) if reaches.any() else most


def draw_drafts(logits: torch.Tensor, seqs: list[Sequence], sampler: Sampler, sampled: bool
                ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """Each row's draft token ([B] on the device), greedy or (`sampled`, for a sequence that samples) drawn at its
    request's temperature and filters, and where it was sampled the distribution q it was drawn from. The noise
    comes from the sequence's seeded generator, else `sampler`'s shared one."""
    tokens = logits.argmax(-1)
    q: list[torch.Tensor | None] = [None] * len(seqs)
    rows_sampled = [r for r, s in enumerate(seqs) if sampled and not s.params.is_greedy]
    if rows_sampled:
        rows = to_device(rows_sampled, torch.long, logits.device)
        params = [seqs[r].params for r in rows_sampled]
        logprobs = sampler.reported_logprobs(logits[rows], [p.temperature for p in params])
        filtered = filter_logprobs(logprobs, params)
        noise = torch.empty_like(filtered).exponential_(generator=sampler.generator)
        for k, r in enumerate(rows_sampled):
            if seqs[r].generator is not None:
                noise[k].exponential_(generator=seqs[r].generator)
        tokens[rows] = race(filtered, noise)
        probs = filtered.softmax(-1)
        for k, r in enumerate(rows_sampled):
            q[r] = probs[k]
    return tokens, q


def set_drafts(batch: ScheduledBatch, steps: list[tuple[list[int], torch.Tensor, list[torch.Tensor | None]]]
               ) -> dict[Sequence, torch.Tensor]:
    """Append each draft step's tokens (per step: the batch indices that drafted, their tokens and distributions)
    to `batch.drafts`; return the distributions of the sampled drafts per sequence ([d, V])."""
    distributions: dict[Sequence, list[torch.Tensor]] = {}
    for active, tokens, q in steps:
        for row, (i, token) in enumerate(zip(active, tokens.tolist())):
            batch.set_drafts(i, batch.drafts[i] + [token])
            if q[row] is not None:
                distributions.setdefault(batch.seqs[i], []).append(q[row])
    return {seq: torch.stack(rows) for seq, rows in distributions.items()}


class Proposer(Protocol):
    def worth_drafting(self, seqs: list[Sequence], num_drafts: int) -> bool:
        """Whether the next step should draft for the decoding sequences `seqs` (at most `num_drafts` each)."""
        ...

    def propose(self, batch: ScheduledBatch) -> dict[Sequence, torch.Tensor]:
        """Fill `batch.drafts` within each sequence's lookahead; return, per sequence whose drafts were sampled,
        the distributions they were drawn from ([d, V] float32)."""
        ...

    def observe(self, batch: ScheduledBatch) -> None:
        """See the step the policy just ran."""
        ...

    def handed_state(self, seq: Sequence) -> torch.Tensor | None:
        """A prefill server: what a decode server's proposer needs, besides the blocks, to draft for `seq`, whose
        prompt this engine just computed to hand over (`take_over` reads it); None: nothing."""
        ...

    def take_over(self, seq: Sequence, start: int, state: torch.Tensor | None) -> None:
        """A decode server: `seq`'s prompt from position `start` on was computed by another engine, whose blocks
        the caller wrote into the policy's cache, with that engine's `handed_state` (None without one)."""
        ...


class NgramProposer:
    MOST_QUIET_STEPS = 32
    """Most steps the rule declines without looking: an index then catches up at most this many tokens, all
    scored (`NgramIndex.extend` scores the last 4 * `HIT_RATE_TOKENS`), so its hit rate is the one that
    following every step gives."""

    def __init__(self, ngram_max: int, min_expected_tokens: float):
        self.ngram_max = ngram_max
        self.min_expected_tokens = min_expected_tokens
        """A step drafts when its decoding sequences are expected to gain at least this many accepted tokens each,
        on average (`engine.speculative.min_expected_tokens`)."""
        self._indexes: dict[Sequence, NgramIndex] = {}
        """Per sequence; those that finished are dropped whenever the table reaches `_prune_at` entries. A plain
        dict: a weak one allocates a reference at every look-up, each step for each sequence."""
        self._prune_at = 1024
        self._quiet_for: list[Sequence] = []
        """The decoding sequences the rule last declined for."""
        self._quiet_steps = 0
        """Steps it declines for them without looking (`steps_that_cannot_draft`)."""

    def worth_drafting(self, seqs: list[Sequence], num_drafts: int) -> bool:
        """A verifying step costs more than a decode step (k + 1 tokens a sequence, and the read it waits for): it
        pays when the drafts are expected to be right often enough, which prompt lookup can tell from how often
        it would have guessed each sequence's recent tokens. Deterministic drafts never change the tokens, so
        this choice changes only the speed.

        Where it declines, the same sequences cannot reach the bar within the next few steps (a step adds one
        token a sequence, and a token moves a hit rate by a sixteenth at most): those steps decline without
        indexing or scoring anything, so a step that does not draft costs the host what it costs without
        speculation. The indexes catch up when the rule looks again, with the hit rates that following each
        step gives: the decisions are those of looking every step."""
        if not seqs:
            return False
        if self._quiet_steps and seqs == self._quiet_for:
            self._quiet_steps -= 1
            return False
        rates = np.array([self._index(seq).hit_rate for seq in seqs])
        if expected_accepted(rates, num_drafts).mean() >= self.min_expected_tokens:
            self._quiet_steps = 0
            return True
        self._quiet_for = seqs
        self._quiet_steps = steps_that_cannot_draft(rates, num_drafts, self.min_expected_tokens,
                                                    self.MOST_QUIET_STEPS)
        return False

    def propose(self, batch: ScheduledBatch) -> dict[Sequence, torch.Tensor]:
        for i, lookahead in enumerate(batch.num_lookahead):
            if lookahead:
                batch.set_drafts(i, self._index(batch.seqs[i]).drafts(lookahead))
        return {}

    def _index(self, seq: Sequence) -> NgramIndex:
        """The sequence's index, caught up with the tokens the host knows."""
        index = self._indexes.get(seq)
        if index is None:
            if len(self._indexes) >= self._prune_at:  # a finished sequence's index is never read again
                self._indexes = {s: i for s, i in self._indexes.items() if not s.is_finished}
                self._prune_at = max(self._prune_at, 2 * len(self._indexes))
            index = self._indexes[seq] = NgramIndex(self.ngram_max)
        if index.num_settled < len(seq.token_ids):
            index.extend(seq.token_ids)
        return index

    def observe(self, batch: ScheduledBatch) -> None:
        """The policy's verifying forward is launched: index each sequence's drafts ahead (`NgramIndex.extend_ahead`),
        so that the lookups scoring them run while the device computes, not after the step is read, where the next
        step waits for them."""
        for seq, drafts in zip(batch.seqs, batch.drafts):
            if drafts:
                self._indexes[seq].extend_ahead(drafts)

    def handed_state(self, seq: Sequence) -> torch.Tensor | None:
        return None

    def take_over(self, seq: Sequence, start: int, state: torch.Tensor | None) -> None:
        """Nothing to do: a sequence's index is built from its tokens, the handed prompt's included, when first read."""


@dataclass
class DraftPosition:
    """A sequence as one draft step computes it: the token at `num_computed_tokens`, its last one or a draft.

    It offers what the step inputs read of a `Sequence` (`step_inputs.py`): a draft the host has not read is,
    like a pending token, the previous draft step's token on the device (row `pending_row`), so a draft step is a
    decode step and the draft steps of a sequence run without waiting for the host. The draft model's prefill of a
    handed prompt (`DraftModelProposer.take_over`) computes a chunk of known tokens from `num_computed_tokens` on
    the same way, and samples nothing."""

    token_ids: list[int]
    block_table: list[int]
    num_computed_tokens: int
    pending_row: int

    @property
    def num_tokens(self) -> int:
        return self.num_computed_tokens + 1


class DraftModelProposer:
    """A smaller model of the same vocabulary drafts, greedily or at the request's temperature and filters, one
    decode step per draft over the sequences that still draft.

    A prompt prefilled by another engine (prefill/decode disaggregation) has no entries in the draft's cache: the
    draft never ran it. This engine runs the draft's prefill over it as it takes it over (`take_over`), rather
    than having the prefill server run the draft too and hand its blocks: the draft is small, so its prefill costs
    a fraction of the policy's, and the prefill server then needs no draft model, no second cache to ship and no
    second layout to agree on. The draft's entries are those it computes on one server, so its drafts are too."""

    def __init__(self, runner: PagedModelRunner, sampler: Sampler, sampled: bool, max_chunk_tokens: int):
        self.runner = runner
        self.sampler = sampler
        """Whose shared generator draws the noise of sequences without a seed."""
        self.sampled = sampled
        self.max_chunk_tokens = max_chunk_tokens
        """Most tokens of a handed prompt in one forward of the draft (`engine.max_num_batched_tokens`, which its
        activations are sized for)."""

    def worth_drafting(self, seqs: list[Sequence], num_drafts: int) -> bool:
        """Always: the draft's own cache follows every step, and how often it is right shows only in verifying."""
        return True

    def propose(self, batch: ScheduledBatch) -> dict[Sequence, torch.Tensor]:
        drafting = [i for i, lookahead in enumerate(batch.num_lookahead) if lookahead]
        steps: list[tuple[list[int], torch.Tensor, list[torch.Tensor | None]]] = []
        previous: torch.Tensor | None = None
        rows: dict[int, int] = {}  # batch index -> its row of the previous draft step
        for j in range(max((batch.num_lookahead[i] for i in drafting), default=0)):
            active = [i for i in drafting if batch.num_lookahead[i] > j]
            step = ScheduledBatch()
            for i in active:
                seq = batch.seqs[i]
                step.add(DraftPosition(seq.token_ids, seq.block_table, seq.num_computed_tokens + j, rows.get(i, -1)), 1)
            tokens, q = draw_drafts(self.runner.run(step, previous).float(), [batch.seqs[i] for i in active],
                                    self.sampler, self.sampled)
            steps.append((active, tokens, q))
            previous, rows = tokens, {i: row for row, i in enumerate(active)}
        return set_drafts(batch, steps)

    def observe(self, batch: ScheduledBatch) -> None:
        self.runner.run(batch)

    def handed_state(self, seq: Sequence) -> torch.Tensor | None:
        return None

    def take_over(self, seq: Sequence, start: int, state: torch.Tensor | None) -> None:
        """The draft's prefill over the handed tokens, in chunks, into its cache's slots of the policy's blocks."""
        for first in range(start, seq.num_prompt_tokens, self.max_chunk_tokens):
            chunk = ScheduledBatch()
            num_new = min(self.max_chunk_tokens, seq.num_prompt_tokens - first)
            chunk.add(DraftPosition(seq.token_ids, seq.block_table, first, -1), num_new)
            self.runner.run(chunk)


class MtpProposer:
    """The policy's own multi-token prediction layer drafts (GLM-5, DeepSeek-V3: `glm_moe_dsa.MultiTokenPrediction`;
    the decoder families' `decoder.DraftHead`): from the policy's final hidden state at position t and token t + 1 it
    computes the LM head's input for token t + 2. Its block attends over entries of its own, kept as extra layers of
    the policy's paged cache (`setup.py`),
    so in the policy's blocks: the entry at position t is made from the policy's hidden state at t and token t + 1.

    After each policy step (`observe`) the layer runs over the step's tokens, each paired with the token after it
    in the step (a prefill chunk's last with the prompt's next token), through the step's own attention plan. The
    last position a sequence computed waits for the token sampled after it: for a sequence whose last token is at
    position p + 1, draft step 0 runs the layer at p on the policy's hidden state there (kept from the step that
    sampled token p + 1; with drafts, the row of the last one accepted) and token p + 1, writing that entry and
    drafting token p + 2. Every decoding sequence runs step 0, drafting or not, so that no entry is left stale. Draft
    step j > 0 runs the layer at p + j on token p + j + 1 (the draft before) and on the layer's own output of step
    j - 1 in place of the policy's hidden state: the layer chained on itself, to draft past its depth of one token.
    A checkpoint with several such layers drafts with the first, chained: a later one would need the one before's
    outputs at every position. The entries drafting writes past p are overwritten when the verifying step computes
    those positions.

    Entries in a block shared by prefix caching are those of the sequence that wrote them: where the token after
    a shared block differs, a draft is worse, never the emitted tokens, which are the policy's.

    Prefill/decode disaggregation: a prefill server with the same `engine.speculative` runs the layer over the
    prompts it computes, as here, so the entries travel in the handed blocks (its cache has the layer's layers too,
    and a decode server takes blocks of its own layout only); it hands the policy's hidden state at the last prompt
    position with the logits row (`handed_state`), so the decode server's draft step 0 writes the last entry and
    drafts as one server's would (`take_over`). Without that state a sequence drafts from its second step on, its
    last prompt position's entry left as the prefill server wrote it (with no token after it): worse drafts there,
    never other tokens. So is an entry that a prefill server wrote at the end of an earlier prompt and hands again
    from its prefix cache (a block the decode server no longer holds)."""

    def __init__(self, runner: PagedModelRunner, sampler: Sampler, sampled: bool, max_num_seqs: int):
        """`runner`: the policy's, keeping each step's forward (`PagedModelRunner.keep_forward`)."""
        assert runner.keep_forward, "the MTP layer runs over the policy's forward"
        self.runner = runner
        self.model = runner.model
        self.sampler = sampler
        self.sampled = sampled
        cache = runner.cache
        self.inputs = StepInputBuilder(runner.device, max_num_seqs, runner.inputs.block_tables.shape[1],
                                       cache.block_size, cache.pad_slot)
        self._hidden: weakref.WeakKeyDictionary[Sequence, tuple[int, torch.Tensor]] = weakref.WeakKeyDictionary()
        """Per sequence, from the last step that sampled it: the position of its first sampled row and the policy's
        final hidden states of its sampled rows ([1 + drafts, hidden]); the accepted count picks the row."""

    def worth_drafting(self, seqs: list[Sequence], num_drafts: int) -> bool:
        """Always: draft step 0 writes the layer's entries of every decoding sequence (see the class docstring)."""
        return True

    def propose(self, batch: ScheduledBatch) -> dict[Sequence, torch.Tensor]:
        active, starts = [], []
        for i, seq in enumerate(batch.seqs):
            kept = self._hidden.get(seq)
            if kept is None or seq.num_uncomputed_tokens != 1:
                continue
            first, rows = kept
            row = seq.num_computed_tokens - 1 - first
            if 0 <= row < rows.shape[0]:
                active.append(i)
                starts.append(rows[row])
        if not active:
            return {}
        hidden = torch.stack(starts)
        tokens = to_device([batch.seqs[i].token_ids[-1] for i in active], torch.long, hidden.device)
        steps: list[tuple[list[int], torch.Tensor, list[torch.Tensor | None]]] = []
        for j in itertools.count():
            hidden = self._predict(batch, active, j, tokens, hidden)
            keep = [k for k, i in enumerate(active) if batch.num_lookahead[i] > j]
            if not keep:
                break
            if len(keep) < len(active):
                hidden = hidden[to_device(keep, torch.long, hidden.device)]
                active = [active[k] for k in keep]
            tokens, q = draw_drafts(self.model.lm_head(hidden).float(), [batch.seqs[i] for i in active], self.sampler,
                                    self.sampled)
            steps.append((active, tokens, q))
        return set_drafts(batch, steps)

    def _predict(self, batch: ScheduledBatch, active: list[int], j: int, tokens: torch.Tensor,
                 hidden: torch.Tensor) -> torch.Tensor:
        """The layer at position p + j of each active sequence (p: its last token's position - 1), on `tokens`
        [B] (the token after that position) and `hidden` [B, hidden]: its output [B, hidden]."""
        step = ScheduledBatch()
        for row, i in enumerate(active):
            seq = batch.seqs[i]
            step.add(DraftPosition([], seq.block_table, seq.num_computed_tokens - 1 + j, row), 1)
        inputs = self.inputs.build(step, previous_tokens=tokens)  # no token on the host: every input is a row of `tokens`
        attention = self.runner.attention_for(step_metadata(inputs, self.inputs.block_tables[:len(active)]))
        return self.model.predict_after_next(hidden[None], inputs.input_ids[None], inputs.positions[None], attention)[0]

    def observe(self, batch: ScheduledBatch) -> None:
        forward, self.runner.last_forward = self.runner.last_forward, None
        if forward is None or not batch.seqs:
            return
        following: list[int] = []
        offset = 0
        for i, (seq, num_new, drafts) in enumerate(zip(batch.seqs, batch.num_new_tokens, batch.drafts)):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new - len(drafts)
            # The token after the step's last one of the sequence: the prompt's next, else not known yet (the
            # entry is written again by the next draft step 0).
            following += seq.token_ids[start + 1:end] + drafts + [seq.token_ids[end] if end < len(seq.token_ids) else 0]
            offset += num_new
            if batch.samples(i):
                self._hidden[seq] = end - 1, forward.hidden[offset - 1 - len(drafts):offset].clone()
        ids = to_device(following, torch.long, forward.hidden.device)
        self.model.predict_after_next(forward.hidden[None], ids[None], forward.inputs.positions[None], forward.attention)

    def handed_state(self, seq: Sequence) -> torch.Tensor | None:
        """The policy's final hidden state [hidden] at the prompt's last position, kept from the step that computed it."""
        kept = self._hidden.get(seq)
        return kept[1][0] if kept is not None else None

    def take_over(self, seq: Sequence, start: int, state: torch.Tensor | None) -> None:
        """Keep the handed hidden state, as if this engine's step had computed the prompt's last position."""
        if state is not None:
            self._hidden[seq] = seq.num_prompt_tokens - 1, state[None]


class VerifiedSample:
    """A verifying step's emitted tokens on their way to the host; `result()` also sets seeded generators back
    to where the emitted tokens' draws leave them (deterministic drafts)."""

    def __init__(self, first_rows: list[int], drafts: list[list[int]], emitted: torch.Tensor,
                 accepted: torch.Tensor | None, logprobs: torch.Tensor, top: tuple[torch.Tensor, torch.Tensor] | None,
                 num_top: list[int], rewinds: dict[int, tuple[torch.Generator, list[torch.Tensor]]]):
        """`accepted`: per row, whether its draft was accepted, where some drafts were sampled; None where every
        draft is deterministic: a draft is then accepted when the row emits it, which the host checks."""
        self._first_rows = first_rows
        """Per sequence, its first row of the step's sampled rows (its last token's); then one per draft."""
        self._drafts = drafts
        rows = [emitted.double(), logprobs.double()] + ([accepted.double()] if accepted is not None else [])
        self._read = HostRead([torch.stack(rows), *(top or ())])
        self._num_top = num_top
        self._rewinds = rewinds
        """Per sequence index, its generator and its states before each row's draw."""

    def result(self) -> SampleResult:
        host = self._read.values()
        emitted, logprobs, *flags = host[0].tolist()
        accepted = flags[0] if flags else None  # None: a draft is accepted where its row emits it
        top_values, top_ids = (host[1].tolist(), host[2].tolist()) if len(host) == 3 else (None, None)
        token_ids, own_logprobs, own_top, accepted_drafts = [], [], [], []
        for i, (first, drafts) in enumerate(zip(self._first_rows, self._drafts)):
            d = len(drafts)
            a = 0
            while a < d and (accepted[first + a] if accepted is not None else emitted[first + a] == drafts[a]):
                a += 1
            rows = []
            for r in range(first, first + a + 1):
                k = self._num_top[r]
                top = tuple(zip(top_ids[r][:k], top_values[r][:k])) if top_ids is not None else ()
                rows.append((int(emitted[r]), logprobs[r], top))
            accepted_drafts.append(rows[:-1])
            token_ids.append(rows[-1][0])
            own_logprobs.append(rows[-1][1])
            own_top.append(rows[-1][2])
            if i in self._rewinds and a < d:
                generator, states = self._rewinds[i]
                generator.set_state(states[a + 1])
        return SampleResult(token_ids, own_logprobs, own_top, accepted_drafts)


class Speculator:
    """Drafts for the scheduled decodes (`propose`), and the acceptance of a verifying step (`verify`)."""

    def __init__(self, proposer: Proposer, sampler: Sampler):
        self.proposer = proposer
        self.sampler = sampler
        self._distributions: dict[Sequence, torch.Tensor] = {}

    def should_draft(self, running: list[Sequence], num_drafts: int) -> bool:
        """Whether the next step makes room for drafts (`Proposer.worth_drafting` of the decoding sequences)."""
        return self.proposer.worth_drafting([s for s in running if s.has_prefilled_prompt], num_drafts)

    def propose(self, batch: ScheduledBatch) -> None:
        self._distributions = self.proposer.propose(batch)

    def observe(self, batch: ScheduledBatch) -> None:
        self.proposer.observe(batch)

    def handed_state(self, seq: Sequence) -> torch.Tensor | None:
        return self.proposer.handed_state(seq)

    def take_over(self, seq: Sequence, start: int, state: torch.Tensor | None) -> None:
        self.proposer.take_over(seq, start, state)

    def verify(self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]]) -> VerifiedSample:
        """logits: per sequence, one row for its last token and one per draft ([sum(1 + d), V])."""
        device = logits.device
        first_rows = np.cumsum([0] + [1 + len(d) for d in drafts])[:-1].tolist()
        row_params = [seq.params for seq, d in zip(seqs, drafts) for _ in range(1 + len(d))]
        temps = [p.temperature for p in row_params]
        logits = logits.float()
        logprobs = self.sampler.reported_logprobs(logits, temps)
        rewinds: dict[int, tuple[torch.Generator, list[torch.Tensor]]] = {}
        if all(seq.params.is_greedy for seq in seqs):
            # No noise to draw (and no sampled draft: those are drawn for sampling requests only).
            sample = logits.argmax(-1)
        else:
            filtered = filter_logprobs(logprobs, row_params)
            noise = torch.empty_like(filtered).exponential_(generator=self.sampler.generator)
            for i, (seq, first) in enumerate(zip(seqs, first_rows)):
                if seq.generator is None or seq.params.is_greedy:
                    continue
                states = []
                for r in range(first, first + 1 + len(drafts[i])):
                    states.append(seq.generator.get_state())
                    noise[r].exponential_(generator=seq.generator)
                if seq not in self._distributions:
                    rewinds[i] = (seq.generator, states)
            sample = race(filtered, noise)
            greedy = [p.is_greedy for p in row_params]
            if any(greedy):
                sample = torch.where(to_device(greedy, torch.bool, device), logits.argmax(-1), sample)
        # A deterministic draft is accepted when the row samples it, so every row emits its sample: the host tells
        # the accepted drafts from the emitted tokens (`VerifiedSample.result`), nothing to compare on the device.
        emitted, accepted = sample, None
        rejection_rows = [r for i, seq in enumerate(seqs) if seq in self._distributions
                          for r in range(first_rows[i], first_rows[i] + len(drafts[i]))]
        if rejection_rows:
            next_draft = to_device([t for d in drafts for t in d + [-1]], torch.long, device)
            accepted, replacement = self._rejection_sample(seqs, filtered, noise, next_draft, sample == next_draft,
                                                           sample, rejection_rows)
            emitted = torch.where(accepted, next_draft, replacement)
        chosen = logprobs.gather(-1, emitted[:, None])[:, 0]
        num_top = [p.num_top_logprobs for p in row_params]
        top = logprobs.topk(max(num_top), dim=-1) if max(num_top) > 0 else None
        self._distributions = {}
        return VerifiedSample(first_rows, drafts, emitted, accepted, chosen, top, num_top, rewinds)

    def _rejection_sample(self, seqs: list[Sequence], filtered: torch.Tensor, noise: torch.Tensor,
                          next_draft: torch.Tensor, accepted: torch.Tensor, sample: torch.Tensor,
                          rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of sampled drafts: accept with probability min(1, p/q), else draw from max(0, p - q)."""
        device = filtered.device
        q = torch.cat([self._distributions[seq] for seq in seqs if seq in self._distributions])
        index = to_device(rows, torch.long, device)
        p = filtered[index].softmax(-1)
        draft = next_draft[index][:, None]
        uniform = torch.empty(len(rows), device=device)
        start = 0
        for seq in seqs:
            if seq in self._distributions:
                n = self._distributions[seq].shape[0]
                uniform[start:start + n].uniform_(generator=seq.generator or self.sampler.generator)
                start += n
        keep = uniform * q.gather(-1, draft)[:, 0] < p.gather(-1, draft)[:, 0]
        residual = (p - q).clamp(min=0)
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)  # p = q: nothing is ever rejected
        accepted = accepted.clone()
        accepted[index] = keep
        replacement = sample.clone()
        replacement[index] = race(residual.log(), noise[index])
        return accepted, replacement
