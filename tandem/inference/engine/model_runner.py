"""Turn a scheduled batch into logits: input prep, one forward pass, the LM head on last tokens.

Two runners share the interface `run(batch, previous_tokens) -> logits [S, V]` (the model's dtype,
one row per sequence that samples this step, in batch order, followed by one per draft it verifies;
`previous_tokens`: the last launched step's sampled tokens on the device, where input ids the host
has not read yet are):
- `PagedModelRunner`: tandem's native models; every token is computed once and its keys and
  values kept in the paged cache (`step_inputs.py` builds the step's tensors, `cuda_graphs.py`
  replays decode steps), or for latent attention its latent entries (`LatentCache`,
  `paged_latent_attention.py`); for a mixture of experts, `routed_experts` holds after each run the
  expert ids that computed each sampled row (`fused_moe.RoutingRecorder`); with a `side_path`
  (`lora_side_path.py`) the tokens it names take it: base sequences' beside merged weights, in an eager step (a
  CUDA graph replays the policy's forward only), or over a shared base the policy's, every row of a step without
  base sequences, graphs included; with `keep_forward` (a multi-token prediction draft, which
  runs its own layer over the policy's step) each eager step's inputs, attention and final hidden states stay
  readable until the next (`last_forward`); with a `cascade` planner, decode-only steps whose sequences share
  a long enough prompt prefix attend with each group's prefix read once (`cascade.py`);
- `RecomputeModelRunner`: any transformers model (the slow path); no cache, each sampling
  sequence runs again from its first token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tandem.kernels.attention import decode_context_bounds, next_pow2
from tandem.inference.engine.cascade import CascadeMetadata, CascadePlanner, group_slots
from tandem.inference.engine.cuda_graphs import DecodeGraphs, graph_batch_sizes
from tandem.inference.engine.fused_moe import RoutingRecorder
from tandem.inference.engine.host_copies import to_device
from tandem.inference.engine.kv_cache import KVCache, LatentCache
from tandem.inference.engine.lora_side_path import EVERY_ROW, LowRankSidePath
from tandem.inference.engine.paged_attention import AttentionMetadata, PagedAttention
from tandem.inference.engine.paged_latent_attention import PagedLatentAttention
from tandem.inference.engine.scheduler import ScheduledBatch
from tandem.inference.engine.step_inputs import StepInputBuilder, StepInputs, decode_tiles
from tandem.models.exact import exact_logits


def step_metadata(step: StepInputs, block_tables: torch.Tensor) -> AttentionMetadata:
    """The attention metadata of an eager step (`block_tables`: the builder's rows of its sequences)."""
    return AttentionMetadata(slot_mapping=step.slot_mapping, query_start=step.query_start, seq_lens=step.seq_lens,
                             block_tables=block_tables, tiles=step.tiles, block_q=step.block_q,
                             query_lens_host=step.query_lens, seq_lens_host=step.seq_lens_host,
                             max_context=max(step.seq_lens_host, default=0), cascade=step.cascade)


@dataclass
class Forward:
    """An eager step as the policy ran it: what another layer needs to run over the same tokens and cache."""

    inputs: StepInputs
    attention: PagedAttention | PagedLatentAttention
    """Its backend, whose plan (query groups) holds for any layer over the same step."""
    hidden: torch.Tensor
    """[N, hidden] the final hidden state of every token of the step (the LM head's input)."""


class PagedModelRunner:
    """Every token is computed once; decode-only steps replay CUDA graphs where enabled (CUDA)."""

    def __init__(self, model: nn.Module, cache: KVCache | LatentCache, device: torch.device, max_num_seqs: int, max_model_len: int,
                 cuda_graphs: bool, recorder: RoutingRecorder | None = None, exact: bool = False,
                 side_path: LowRankSidePath | None = None, keep_forward: bool = False,
                 cascade: CascadePlanner | None = None, num_draft_tokens: int = 0):
        """`exact`: the model has `tandem.models.exact.apply_exact`; attention and head follow it (graphs only where
        its whole forward takes the kernel path: `tandem.models.exact.model_uses_kernels`). `side_path`: installed on
        the model (`lora_side_path.apply_side_path`), given the rows that take it for each step (`_side_rows`).
        `keep_forward`: keep each step's `Forward` (`last_forward`); its steps run eager. `cascade`: plans
        decode-only steps' shared prefixes (not with `exact`: the cascade is not batch invariant).
        `num_draft_tokens` (k, speculative decoding): with graphs, steps that verify drafts replay graphs of k + 1
        tokens a sequence too (not in exact mode, whose attention plans each token on the host, nor over a latent
        cache, whose steps of several tokens a sequence group them on the host: `paged_latent_attention.py`)."""
        assert not (keep_forward and cuda_graphs and device.type == "cuda"), "a replayed graph keeps no hidden states"
        assert not (cascade and exact), "cascade attention is not batch invariant"
        self.cascade = cascade
        self.model = model
        self.keep_forward = keep_forward
        self.last_forward: Forward | None = None
        self.side_path = side_path
        self.exact = exact
        self.cache = cache
        self.device = device
        self.recorder = recorder
        self.routed_experts: torch.Tensor | None = None
        """After `run`: [S, num_moe_layers, k] expert ids of each sampled row's forward (MoE models), else None."""
        self.replayed_graph = False
        """After `run`: whether it replayed a CUDA graph (step records tell graph steps from eager ones)."""
        self.inputs = StepInputBuilder(device, max_num_seqs, -(-max_model_len // cache.block_size), cache.block_size,
                                       cache.pad_slot)
        self.graphs: DecodeGraphs | None = None
        self.verify_graphs: DecodeGraphs | None = None
        if cuda_graphs and device.type == "cuda":
            self._tokens_per_seq = 1 + (num_draft_tokens if not (exact or isinstance(cache, LatentCache)) else 0)
            self._static = torch.zeros(4, max_num_seqs * self._tokens_per_seq, dtype=torch.long, device=device)
            """Inputs the graphs read: token ids, positions, slots, context lengths (rows of the padded batch; a
            verifying graph's token rows in the first three)."""
            self._static[2] = cache.pad_slot  # the warmup and capture steps write nowhere that matters
            self._query_start = torch.arange(max_num_seqs + 1, device=device)
            self._tiles = {b: torch.tensor(decode_tiles(b), device=device) for b in graph_batch_sizes(max_num_seqs)}
            if cascade is not None:
                slots = group_slots(max_num_seqs)
                self._static_cascade = CascadeMetadata(
                    row_prefix=torch.zeros(max_num_seqs, dtype=torch.long, device=device),
                    group_prefix=torch.zeros(slots, dtype=torch.long, device=device),
                    group_members=torch.full((slots, cascade.members), -1, dtype=torch.long, device=device))
                """The plan the cascade graphs read (no groups: the warmup and capture steps attend plainly)."""
            with torch.no_grad():
                self.graphs = DecodeGraphs(self._graph_forward, max_num_seqs, decode_context_bounds(max_model_len),
                                           cascade=cascade is not None)
                if self._tokens_per_seq > 1:
                    self._verify_block_q = next_pow2(self._tokens_per_seq)
                    self._verify_static = torch.zeros(2, max_num_seqs + 2, dtype=torch.long, device=device)
                    """A verifying graph's context lengths and query starts (`StepInputBuilder.build_verify`)."""
                    self._verify_tiles = {b: torch.zeros(2, 2 * b, dtype=torch.long, device=device)
                                          for b in graph_batch_sizes(max_num_seqs)}
                    # The tile kernel walks each sequence's whole context: one bound serves every step.
                    self.verify_graphs = DecodeGraphs(self._verify_graph_forward, max_num_seqs, [max_model_len])

    def _graph_forward(self, b: int, max_context: int, cascade: bool) -> torch.Tensor:
        static = self._static
        plan = None
        if cascade:
            slots = group_slots(b)
            plan = CascadeMetadata(self._static_cascade.row_prefix[:b], self._static_cascade.group_prefix[:slots],
                                   self._static_cascade.group_members[:slots])
        meta = AttentionMetadata(slot_mapping=static[2, :b], query_start=self._query_start[:b + 1], seq_lens=static[3, :b],
                                 block_tables=self.inputs.block_tables[:b], tiles=self._tiles[b], block_q=1,
                                 max_context=max_context, cascade=plan)
        hidden = self._forward(static[0, :b], static[1, :b], self.attention_for(meta))
        return self._logits(hidden[0])

    def _verify_graph_forward(self, b: int, max_context: int, cascade: bool) -> torch.Tensor:
        """A verifying step of b sequences of up to k + 1 tokens each, in `StepInputBuilder.build_verify`'s layout:
        its final hidden states. The LM head runs after the replay, over the real rows only: a graph's logits of
        every padded row would hold (k + 1) x vocabulary per sequence for good, for each batch size."""
        n = b * self._tokens_per_seq
        static, lengths = self._static, self._verify_static
        meta = AttentionMetadata(slot_mapping=static[2, :n], query_start=lengths[1, :b + 2], seq_lens=lengths[0, :b + 1],
                                 block_tables=self.inputs.block_tables, tiles=self._verify_tiles[b],
                                 block_q=self._verify_block_q)
        return self._forward(static[0, :n], static[1, :n], self.attention_for(meta))[0]

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 attention: PagedAttention | PagedLatentAttention) -> torch.Tensor:
        """The model over one step's tokens [N]: hidden states [1, N, hidden]; the routing recorder's rows restart at
        the step's first token."""
        if self.recorder is not None:
            self.recorder.start_forward()
        return self.model(input_ids[None], positions[None], attention=attention)

    def _replay_verify(self, batch: ScheduledBatch) -> torch.Tensor:
        """A step of decoding sequences with drafts through its graph: the logits of its real rows."""
        b = len(batch.seqs)
        padded = self.verify_graphs.padded(b)
        step = self.inputs.build_verify(batch, padded, self._tokens_per_seq, self._verify_block_q)
        n = step.input_ids.shape[0]
        for row, values in enumerate((step.input_ids, step.positions, step.slot_mapping)):
            self._static[row, :n].copy_(values)
        self._verify_static[0, :padded + 1].copy_(step.seq_lens)
        self._verify_static[1, :padded + 2].copy_(step.query_start)
        self._verify_tiles[padded].copy_(step.tiles)
        hidden = self.verify_graphs.replay(b, 0, False, step.sample_index.shape[0])
        self._record_routing(step.sample_index)
        return self._logits(hidden)

    @torch.no_grad()
    def run(self, batch: ScheduledBatch, previous_tokens: torch.Tensor | None = None) -> torch.Tensor:
        b = len(batch.seqs)
        self.replayed_graph = True
        side_rows = self._side_rows(batch)
        plain = self.side_path is None or side_rows is self.side_path.default_rows  # what the graphs captured
        if (self.verify_graphs is not None and batch.has_drafts and batch.is_verify_only and b <= self.verify_graphs.max_batch
                and plain):
            return self._replay_verify(batch)  # every input known: a step that drafts follows a read step
        plan = self.cascade.plan(batch.seqs) if self.cascade is not None and batch.is_decode_only else None
        members = self.cascade.members if plan is not None else 0
        if self.graphs is not None and b <= self.graphs.max_batch and batch.is_decode_only and plain:
            step = self.inputs.build(batch, pad_to=self.graphs.padded(b), previous_tokens=previous_tokens, cascade=plan,
                                     members=members)
            size = step.input_ids.shape[0]
            for row, values in enumerate((step.input_ids, step.positions, step.slot_mapping, step.seq_lens)):
                self._static[row, :size].copy_(values)
            if step.cascade is not None:
                static, slots = self._static_cascade, step.cascade.group_prefix.shape[0]
                static.row_prefix[:size].copy_(step.cascade.row_prefix)
                static.group_prefix[:slots].copy_(step.cascade.group_prefix)
                static.group_members[:slots].copy_(step.cascade.group_members)
            logits = self.graphs.replay(b, max(step.seq_lens_host, default=0), step.cascade is not None)
            self._record_routing(self._query_start[:b])  # rows 0..b-1
            return logits
        self.replayed_graph = False
        step = self.inputs.build(batch, previous_tokens=previous_tokens, cascade=plan, members=members)
        attention = self.attention_for(step_metadata(step, self.inputs.block_tables[:b]))
        if self.side_path is not None:
            self.side_path.rows = side_rows
        try:
            hidden = self._forward(step.input_ids, step.positions, attention)
        finally:
            if self.side_path is not None:
                self.side_path.rows = self.side_path.default_rows
        if self.keep_forward:
            self.last_forward = Forward(step, attention, hidden[0])
        self._record_routing(step.sample_index)
        return self._logits(hidden[0, step.sample_index])

    def _side_rows(self, batch: ScheduledBatch) -> torch.Tensor | slice | None:
        """The step's token rows that take the side path (each such sequence's new tokens, in batch order): base
        sequences' where it corrects them, else the policy's; `EVERY_ROW` when all do, None when none does."""
        side = self.side_path
        if side is None:
            return None
        takes = [seq.is_base == side.corrects_base for seq in batch.seqs]
        if all(takes):
            return EVERY_ROW
        if not any(takes):
            return None
        rows, start = [], 0
        for took, num_new in zip(takes, batch.num_new_tokens):
            if took:
                rows.extend(range(start, start + num_new))
            start += num_new
        return to_device(rows, torch.long, self.device)

    def attention_for(self, meta: AttentionMetadata) -> PagedAttention | PagedLatentAttention:
        """The backend of a step over this runner's cache."""
        if isinstance(self.cache, LatentCache):
            return PagedLatentAttention(self.cache, meta, self.model.args.index_topk)
        return PagedAttention(self.cache, meta, self.exact)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.exact:
            return exact_logits(hidden, self.model.lm_head.weight, self.model.lm_head.bias)
        return self.model.lm_head(hidden)

    def _record_routing(self, sample_index: torch.Tensor) -> None:
        # A gather, so a copy: the next step's forward overwrites the recorder, not this.
        self.routed_experts = None if self.recorder is None else self.recorder.rows(sample_index)


class RecomputeModelRunner:
    """No KV cache: each sampling sequence runs again from its first token, one forward pass each.

    It needs every token on the host, so its engine reads each step before the next (no overlap).

    One pass per sequence, not one packed row: a packed row's attention mask grows with the square
    of the whole batch's tokens, a sequence's only with its own.
    """

    recorder = None
    routed_experts = None
    """No expert routing is reported on this path (see `PagedModelRunner`)."""
    replayed_graph = False

    def __init__(self, model: nn.Module, device: torch.device):
        self.model = model
        self.device = device

    @torch.no_grad()
    def run(self, batch: ScheduledBatch, previous_tokens: torch.Tensor | None = None) -> torch.Tensor:
        assert previous_tokens is None, "the recompute path reads every step before the next"
        rows = []
        for i, seq in enumerate(batch.seqs):
            if batch.samples(i):  # a chunk that does not reach the end leaves nothing to keep
                ids = torch.tensor([seq.token_ids + batch.drafts[i]], device=self.device)
                hidden = self.model(ids, torch.arange(ids.shape[1], device=self.device)[None])
                rows.append(hidden[0, -1 - len(batch.drafts[i]):])
        if not rows:
            return torch.empty(0, self.model.lm_head.weight.shape[0], device=self.device)
        return self.model.lm_head(torch.cat(rows))
