"""The synchronous engine core: requests in, one token per running sequence per step out.

A step is schedule -> run -> sample (launched on the device) -> read -> postprocess. With
`overlap` (CUDA), `step()` schedules and launches step N+1 before it reads step N: the host's
work (scheduling, inputs, postprocessing; a millisecond or more per step) then runs while the GPU
computes, instead of the GPU waiting for it. Step N+1 is planned from what the host knows: each
sequence of step N continues with its token still pending on the device (`sequence.py`), and
`step_inputs.py` copies that token into step N+1's inputs on the device. The price: a sequence
that stops at EOS, a stop token or a stop string computes one more token, which is dropped;
one that ends at `max_tokens` is not scheduled again. Without `overlap` each step is read at once.

With a `speculator` (speculative decoding, `speculative.py`) a step first drafts tokens for its decoding
sequences, the policy computes each one's last token and drafts at once, and reading the step emits the
accepted drafts and then the policy's own token, each through the same stop checks as any token. With
`overlap`, only steps that draft give it up: drafts follow a sequence's last token, so the step in flight is
read before a step that drafts is planned, and the next step cannot be planned before the accepted counts are
read, so a step that verifies drafts is read at once. Whether a step drafts is the speculator's call
(`Speculator.should_draft`); a step that does not is a plain decode step, overlapped as without speculation.

Nothing here is thread-safe: one thread owns the engine (`async_engine.AsyncEngine`), and weight
updates, like new requests, take effect between two `step()` calls, so for the steps launched
after them. A token's logprob therefore always comes from the weights that sampled it, and
`weight_version` of an output is the oldest version that sampled any of its tokens.

Beside a LoRA policy the engine can serve the base model (`base_path`, `lora_side_path.py`): a request added
with `is_base` is computed with the current adapters subtracted, in the same steps as the policy's, and reports
`BASE_WEIGHT_VERSION`: the base is the starting model, policy 0, whatever the policy's version now.
"""

from __future__ import annotations

from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass, field
import time
from typing import Any, Protocol

import torch
from torch import nn

from tandem.inference.engine.block_manager import BlockManager
from tandem.inference.engine.fused_moe import RoutingRecorder
from tandem.inference.engine.host_copies import HostRead
from tandem.inference.engine.lora_merge import AdapterMerger
from tandem.inference.engine.lora_side_path import LowRankSidePath
from tandem.inference.engine.prefilled import PrefilledPrompt
from tandem.inference.engine.sampler import PendingSample, Sampler
from tandem.inference.engine.sampling_params import InvalidRequest, SamplingParams
from tandem.inference.engine.scheduler import ScheduledBatch, Scheduler
from tandem.inference.engine.sequence import Sequence, SequenceStatus
from tandem.inference.engine.speculative import Speculator, VerifiedSample
from tandem.inference.engine.step_records import StepRecords, StepShape
from tandem.models.loading import load_weights_into
from tandem.models.lora import LoraSpec, is_adapter_name
from tandem.models.multi_token import without_left_out_layers

BASE_WEIGHT_VERSION = 0
"""The weight version base-model outputs report: policy 0 is the base (its adapters' B start at zero)."""


class ModelRunner(Protocol):
    recorder: RoutingRecorder | None
    """Where the MoE blocks write their expert ids (mixtures of experts on the paged path), else None."""
    routed_experts: torch.Tensor | None
    """After `run`, for a mixture of experts: [S, num_moe_layers, k] expert ids of each sampled row; else None."""
    replayed_graph: bool
    """After `run`: whether its forward replayed a CUDA graph."""

    def run(self, batch: ScheduledBatch, previous_tokens: torch.Tensor | None = None) -> torch.Tensor: ...


@dataclass
class LaunchedStep:
    """A step on the device whose sampled tokens the host has not read yet."""

    seqs: list[Sequence]
    """The sequences that sample, in the order of the sampled rows."""
    sample: PendingSample | VerifiedSample
    weight_version: int
    routed_experts: HostRead | None = None
    """The sampled rows' expert ids on their way to the host, when a sequence asked for them."""
    drafts: list[list[int]] | None = None
    """A step that verifies drafts: per sequence, the drafted tokens its rows after the first verify."""
    reserved_lookahead: bool = False
    """The step was scheduled with room for drafts: reading it gives back the blocks that no token took."""
    shape: StepShape | None = None
    """What it held, where the engine keeps step records."""


@dataclass
class PendingImport:
    """Handed-over blocks being written into the cache on the engine's `import_stream` (CUDA)."""

    done: torch.cuda.Event
    """Recorded on the import stream after the copy."""
    block_ids: frozenset[int]
    overlapped: bool = False
    """A step was launched beside the copy (none of its sequences held these blocks); the next one waits for it."""


@dataclass
class SequenceOutput:
    """What a sequence gained in one step (incremental requests), or all of it at its end (the others)."""

    request_id: str
    index: int
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[tuple[tuple[int, float], ...]]
    text: str
    """New text; held back near the end while a stop string could still complete."""
    finish_reason: str | None
    """None while running; "stop" (EOS, stop token or stop string) or "length" at the end."""
    weight_version: int
    routed_experts: list[list[list[int]]] = field(default_factory=list)
    """Per token of `token_ids`, [MoE layer][k] expert ids (requests with `return_routed_experts`)."""
    prefilled: PrefilledPrompt | None = None
    """A prefill-only request's result (`add_prefill`), with finish reason "prefilled" and no tokens."""
    num_draft_tokens: int = 0
    """Drafted tokens verified for the sequence so far, all its steps together (speculative decoding)."""
    num_accepted_tokens: int = 0
    """Of those, the tokens the policy accepted."""


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_prompt_tokens: int
    num_generation_tokens: int
    num_preemptions: int
    weight_version: int
    num_draft_tokens: int
    """Tokens drafted and verified (speculative decoding)."""
    num_accepted_tokens: int
    """Drafted tokens the policy accepted."""


class LLMEngine:
    def __init__(
        self,
        runner: ModelRunner,
        weight_target: nn.Module,
        tokenizer: Any,
        block_manager: BlockManager,
        scheduler: Scheduler,
        sampler: Sampler,
        eos_token_ids: set[int],
        max_model_len: int,
        vocab_size: int,
        device: torch.device,
        overlap: bool = False,
        adapters: AdapterMerger | None = None,
        speculator: Speculator | None = None,
        base_path: LowRankSidePath | None = None,
        step_records: StepRecords | None = None,
    ):
        self.runner = runner
        self.weight_target = weight_target
        """The module whose HF-named state dict `update_weights` loads into."""
        self.tokenizer = tokenizer
        self.block_manager = block_manager
        self.scheduler = scheduler
        self.sampler = sampler
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.device = device
        self.overlap = overlap
        """Launch each step before reading the previous one (see the module docstring)."""
        self.adapters = adapters
        """With `engine.lora`: the kept base, which every update's adapters are merged into; None serves full weights."""
        self.base_path = base_path
        """With `engine.lora` and the base model served: the side path (installed on the runner's model) that
        subtracts the adapters from base sequences' rows, given each update's adapters; None: the policy alone."""
        self.speculator = speculator
        self.step_records = step_records
        """A record per step (`step_records.py`), where `engine.num_step_records` asks for them; else None."""
        self.in_flight: LaunchedStep | None = None
        self.weight_version = 0
        self.requests: dict[str, list[Sequence]] = {}
        self.waiting_prefilled: deque[tuple[list[Sequence], PrefilledPrompt]] = deque()
        """Requests whose prompt another engine computed, waiting for room (`add_prefilled`)."""
        self.import_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        """CUDA: the stream that writes handed-over KV blocks into the cache, beside the steps (`_import`)."""
        self.pending_imports: list[PendingImport] = []
        """Imports on `import_stream` that no step has waited for yet."""
        self.prefilled: list[tuple[Sequence, torch.Tensor]] = []
        """Sequences admitted from `waiting_prefilled`, each with the logits row that the next launched step samples
        its first token from."""
        self.num_prefilled_taken = 0
        """Requests that continued from a prompt prefilled elsewhere."""
        self.num_prefilled_refused = 0
        """Requests prefilled elsewhere that this engine prefilled again (see `add_prefilled`)."""
        self.handed_off: list[SequenceOutput] = []
        """Prefill-only results of the step just launched, returned by this `step()`."""
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if the request cannot run; safe to call from any thread."""
        if not prompt_token_ids:
            raise InvalidRequest("the prompt is empty: it needs at least one token", "prompt")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"prompt token ids must be in [0, {self.vocab_size}), got {bad[:5]}", "prompt")
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise InvalidRequest(f"`stop_token_ids` must be in [0, {self.vocab_size}), got {bad[:5]}", "stop_token_ids")
        if params.return_routed_experts and self.runner.recorder is None:
            raise InvalidRequest("`return_routed_experts` needs a mixture-of-experts model served by the paged engine",
                                 "return_routed_experts")
        n = len(prompt_token_ids)
        if n + params.max_tokens > self.max_model_len:
            raise InvalidRequest(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} in the completion). "
                "Please reduce the length of the prompt or of the completion (`max_tokens`).", "max_tokens"
            )

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, n: int = 1,
                    incremental: bool = True, is_base: bool = False) -> None:
        """Queue `n` samples of one prompt (they share its prefill through the prefix cache).

        `incremental`: an output per sampled token (for streaming); else one per sequence, at its end.
        `is_base`: sample from the base model, not the policy (needs `base_path`).
        """
        if is_base and self.base_path is None:
            raise ValueError("this engine serves the policy alone: the base model is served beside a LoRA policy only")
        seqs = self._new_sequences(request_id, prompt_token_ids, params, n, incremental, is_base)
        self.requests[request_id] = seqs
        for seq in seqs:
            self.scheduler.add(seq)
        self.num_prompt_tokens += len(prompt_token_ids)

    def _new_sequences(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, n: int,
                       incremental: bool, is_base: bool = False) -> list[Sequence]:
        self.check_request(prompt_token_ids, params)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        seqs: list[Sequence] = []
        for i in range(n):
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.device).manual_seed(params.seed + i)
            seqs.append(Sequence(request_id, i, prompt_token_ids, params, self.tokenizer, generator, incremental, is_base))
        return seqs

    def add_prefill(self, request_id: str, prompt_token_ids: list[int], first_block: int = 0) -> None:
        """Queue a prompt to prefill only (a prefill server): once computed, its KV blocks from `first_block` on and
        its last logits row come back as one output (`SequenceOutput.prefilled`, finish reason "prefilled"), and
        nothing is sampled. Its full blocks stay in this engine's prefix cache, like any prompt's."""
        self.add_request(request_id, prompt_token_ids, SamplingParams(max_tokens=1), incremental=False)
        seq = self.requests[request_id][0]
        seq.hand_off_from_block = first_block

    def add_prefilled(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, n: int,
                      incremental: bool, prefilled: PrefilledPrompt) -> None:
        """Queue a request whose prompt another engine prefilled. Before each step, waiting ones are admitted first
        (they cost no compute), in order, once the batch and the cache have room: the first sample continues from
        `prefilled` (its blocks written into this cache, its first token sampled from the handed row by that step),
        the others share its blocks through the prefix cache as the `n` samples of any request do. One that cannot
        continue from it when admitted (other weights computed it, the leading blocks it left out are no longer
        cached here, its blocks are not this cache's shape) is prefilled here instead: a request never fails for
        its prefill server."""
        seqs = self._new_sequences(request_id, prompt_token_ids, params, n, incremental)
        self.requests[request_id] = seqs
        self.num_prompt_tokens += len(prompt_token_ids)
        self.waiting_prefilled.append((seqs, prefilled))

    def _admit_prefilled(self) -> None:
        while self.waiting_prefilled:
            seqs, prefilled = self.waiting_prefilled[0]
            if len(self.scheduler.running) >= self.scheduler.max_num_seqs or not self.block_manager.can_allocate(seqs[0]):
                return
            self.waiting_prefilled.popleft()
            if self._continue_from(seqs[0], prefilled):
                self.num_prefilled_taken += 1
                rest = seqs[1:]
            else:
                self.num_prefilled_refused += 1
                rest = seqs
            for seq in rest:
                self.scheduler.add(seq)

    def _continue_from(self, first: Sequence, prefilled: PrefilledPrompt) -> bool:
        """Run `first` from the handed prompt, if it can (see `add_prefilled`); False with nothing held."""
        if prefilled.weight_version != self.weight_version:
            return False
        self.block_manager.allocate(first)
        num_cached = first.num_computed_tokens // self.block_manager.block_size
        try:
            if num_cached < prefilled.first_block:
                raise ValueError("leading blocks left out are no longer cached here")
            dim, blocks, skip = self.runner.cache.exported_block_dim, prefilled.kv_blocks, num_cached - prefilled.first_block
            self._import(first.block_table[num_cached:], blocks.narrow(dim, skip, blocks.shape[dim] - skip))
        except ValueError:
            self.block_manager.free_blocks(first)
            first.num_computed_tokens = 0
            return False
        if self.step_records is not None:
            self.step_records.num_imported_tokens += first.num_prompt_tokens - num_cached * self.block_manager.block_size
        first.num_computed_tokens = first.num_prompt_tokens
        if self.speculator is not None:
            self.speculator.take_over(first, num_cached * self.block_manager.block_size, prefilled.draft_state)
        self.block_manager.register_computed_blocks(first)
        self.scheduler.add_running(first)
        self.prefilled.append((first, prefilled.logits))
        return True

    def _import(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Write handed-over blocks into the cache (ValueError, nothing written, if they do not fit it). On CUDA on
        `import_stream`, once the work queued so far is done (a step in flight may still write blocks that were just
        freed and are now these), so the copy runs beside the next step instead of ahead of it: that step samples
        the handed prompt's first token from its logits row and reads none of its blocks unless another sequence
        shares them; `_wait_for_imports` holds back each forward that could read them."""
        cache = self.runner.cache
        if self.import_stream is None:
            cache.import_blocks(block_ids, blocks)
            return
        self.import_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.import_stream):
            cache.import_blocks(block_ids, blocks)
            done = torch.cuda.Event()
            done.record()
        blocks.record_stream(self.import_stream)  # its memory is not reused before the copy has read it
        self.pending_imports.append(PendingImport(done, frozenset(block_ids)))

    def _wait_for_imports(self, batch: ScheduledBatch) -> None:
        """Before a step's forward: have the device wait for each pending import, unless this is the first step
        launched since it and none of its sequences holds one of its blocks (a shared prefix, a block taken again
        after a preemption): so each copy overlaps one step, and no step reads its blocks before it is done."""
        pending, self.pending_imports = self.pending_imports, []
        for entry in pending:
            if entry.overlapped or any(not entry.block_ids.isdisjoint(seq.block_table) for seq in batch.seqs):
                torch.cuda.current_stream(self.device).wait_event(entry.done)
            else:
                entry.overlapped = True
                self.pending_imports.append(entry)

    def abort_request(self, request_id: str) -> None:
        for entry in [e for e in self.waiting_prefilled if e[0][0].request_id == request_id]:
            self.waiting_prefilled.remove(entry)
            for seq in entry[0]:
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        for seq in self.requests.pop(request_id, []):
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")

    @property
    def has_unfinished(self) -> bool:
        return (self.scheduler.has_unfinished or self.in_flight is not None or bool(self.prefilled)
                or bool(self.waiting_prefilled))

    @torch.no_grad()
    def step(self) -> list[SequenceOutput]:
        """Launch the next step; return the outputs of the step read now (this one, or with `overlap` the previous one).

        Without autograd throughout, whatever runs the model in it (the runner, a speculative draft's own calls: an
        MTP layer): a model that writes the paged cache under autograd makes the cache a node of a graph that every
        later write extends, held for good."""
        if self.step_records is None:
            return self._step()
        self.step_records.start_step()
        outputs = self._step()
        self.step_records.end_step()
        return outputs

    def _step(self) -> list[SequenceOutput]:
        with self.step_records.admitting() if self.step_records is not None else nullcontext():
            self._admit_prefilled()
        read: list[SequenceOutput] = []
        draft = self.speculator is not None and self.speculator.should_draft(self.scheduler.running,
                                                                             self.scheduler.num_lookahead_tokens)
        if draft and self.in_flight is not None:
            read = self.flush()  # drafts follow each sequence's last token: the host must know it first
        batch = self.scheduler.schedule(lookahead=draft)
        try:
            launched = self._launch(batch) if batch.seqs or self.prefilled else None
        except BaseException:
            self.in_flight = None  # the caller fails the requests; nothing in flight survives a failed step
            raise
        handed_off, self.handed_off = self.handed_off, []
        if not self.overlap or (launched is not None and launched.drafts is not None):
            # A verifying step is read at once: the next one is planned from its accepted counts.
            previous, self.in_flight = self.in_flight, None
            return handed_off + read + self._read(previous) + self._read(launched)
        previous, self.in_flight = self.in_flight, launched
        return handed_off + read + self._read(previous)

    def flush(self) -> list[SequenceOutput]:
        """Read the step in flight, if any, launching nothing (before a pause holds)."""
        previous, self.in_flight = self.in_flight, None
        return self._read(previous)

    def _launch(self, batch: ScheduledBatch) -> LaunchedStep | None:
        self._wait_for_imports(batch)
        if self.speculator is not None and batch.seqs:  # with no room to draft too: an MTP draft writes its entries
            self.speculator.propose(batch)
        # Only a `PendingSample` is ever in flight: a verifying step is read at once.
        previous_tokens = self.in_flight.sample.tokens if self.in_flight is not None else None
        logits = self.runner.run(batch, previous_tokens) if batch.seqs else None
        if self.speculator is not None and batch.seqs:  # none: a step that samples handed prompts' rows alone
            self.speculator.observe(batch)
        sampled = [i for i in range(len(batch.seqs)) if batch.samples(i)]
        num_prefill_tokens = 0 if self.step_records is None else sum(
            max(0, min(n, seq.num_prompt_tokens - seq.num_computed_tokens)) for seq, n in zip(batch.seqs, batch.num_new_tokens))
        for seq, num_new, seq_drafts in zip(batch.seqs, batch.num_new_tokens, batch.drafts):
            seq.num_computed_tokens += num_new - len(seq_drafts)  # drafts count once accepted (`Sequence.accept_draft`)
            self.block_manager.register_computed_blocks(seq)
        routed_rows = self.runner.routed_experts
        drafts = [batch.drafts[i] for i in sampled] if batch.has_drafts else None
        if any(batch.seqs[i].hand_off_from_block is not None for i in sampled):
            kept, rows = self._hand_off(logits, [batch.seqs[i] for i in sampled], drafts)
            logits, sampled = logits[rows], [sampled[k] for k in kept]
            drafts = [drafts[k] for k in kept] if drafts is not None else None
            routed_rows = routed_rows[rows] if routed_rows is not None else None
        sampling = [batch.seqs[i] for i in sampled]
        num_own = len(sampling)
        logits = self._with_prefilled_rows(logits, sampling)
        shape = None
        if self.step_records is not None:
            shape = self.step_records.shape(len(sampling), batch.num_tokens, num_prefill_tokens,
                                            len(sampling) - num_own, bool(batch.seqs) and self.runner.replayed_graph)
        if not sampling:
            return None
        if drafts is not None:  # a sequence prefilled elsewhere samples its handed row as one with no drafts
            drafts += [[] for _ in range(len(sampling) - num_own)]
            sample = self.speculator.verify(logits, sampling, drafts)
        else:
            sample = self.sampler.sample(logits, sampling)
        for row, seq in enumerate(sampling):
            seq.mark_pending(row)
        routed = None
        if routed_rows is not None and any(s.params.return_routed_experts for s in sampling):
            routed = HostRead([routed_rows])  # rows of the batch's own sequences, which come first
        return LaunchedStep(sampling, sample, self.weight_version, routed, drafts, any(batch.num_lookahead), shape)

    def _hand_off(self, logits: torch.Tensor, sampling: list[Sequence], drafts: list[list[int]] | None
                  ) -> tuple[list[int], list[int]]:
        """Finish the prefill-only sequences among `sampling` with their KV blocks and logits row as outputs of this
        step (`logits`: 1 + `drafts` rows per sequence, one without drafts; a prefill-only one has none); returns the
        others' indices in `sampling` and their rows of `logits`."""
        kept, rows = [], []
        end = 0
        for k, seq in enumerate(sampling):
            row, end = end, end + 1 + (len(drafts[k]) if drafts is not None else 0)
            if seq.hand_off_from_block is None:
                kept.append(k)
                rows.extend(range(row, end))
                continue
            blocks = self.runner.cache.export_blocks(seq.block_table[seq.hand_off_from_block:])
            draft_state = self.speculator.handed_state(seq) if self.speculator is not None else None
            handed_logits = logits[row].clone()
            ready = torch.cuda.Event() if blocks.is_cuda else None
            if ready is not None:
                ready.record()  # after the exports: a sender waits for them alone (`PrefilledPrompt.ready`)
            prefilled = PrefilledPrompt(blocks, handed_logits, self.weight_version, seq.hand_off_from_block,
                                        draft_state, ready)
            self.handed_off.append(SequenceOutput(seq.request_id, seq.index, [], [], [], "", "prefilled",
                                                  self.weight_version, prefilled=prefilled))
            self.scheduler.finish(seq, "prefilled")
            self.requests.pop(seq.request_id, None)
        return kept, rows

    def _with_prefilled_rows(self, logits: torch.Tensor | None, sampling: list[Sequence]) -> torch.Tensor | None:
        """`logits` with a row appended for each sequence prefilled elsewhere that still waits for its first token
        (and the sequence appended to `sampling`): one preempted or aborted since has no KV here any more and is
        computed here again or dropped."""
        ready = [(seq, row) for seq, row in self.prefilled if seq.status is SequenceStatus.RUNNING]
        self.prefilled = []
        if not ready:
            return logits
        rows = [row.to(self.device) for _, row in ready]
        dtype = logits.dtype if logits is not None else rows[0].dtype
        sampling += [seq for seq, _ in ready]
        return torch.cat([*([logits] if logits is not None else []), *(row[None].to(dtype) for row in rows)])

    def _read(self, step: LaunchedStep | None) -> list[SequenceOutput]:
        if step is None:
            return []
        waited_from = time.perf_counter()
        result = step.sample.result()
        routed = step.routed_experts.values()[0].tolist() if step.routed_experts is not None else None
        if self.step_records is not None:
            self.step_records.read(step.shape, time.perf_counter() - waited_from)
        outputs: list[SequenceOutput] = []
        row = 0  # the sampled row of each token: one per sequence, plus one per draft in a verifying step
        for j, seq in enumerate(step.seqs):
            num_rows = 1 + (len(step.drafts[j]) if step.drafts is not None else 0)
            row, first_row = row + num_rows, row
            if seq.is_finished:  # stopped by its previous token, or aborted, while this step ran
                continue
            version = BASE_WEIGHT_VERSION if seq.is_base else step.weight_version
            wants_experts = routed is not None and seq.params.return_routed_experts
            if result.accepted_drafts is not None:
                accepted = result.accepted_drafts[j]
                self.num_draft_tokens += num_rows - 1
                self.num_accepted_tokens += len(accepted)
                seq.num_draft_tokens += num_rows - 1
                seq.num_accepted_tokens += len(accepted)
                for m, (token, logprob, top) in enumerate(accepted):
                    experts = routed[first_row + m] if wants_experts else None
                    seq.accept_draft(token, logprob, top, version, experts)
                    self._emitted(seq, outputs)
                    if seq.is_finished:
                        break
                if seq.is_finished:
                    continue
                first_row += len(accepted)
            seq.append_token(result.token_ids[j], result.logprobs[j], result.top_logprobs[j], version,
                             routed[first_row] if wants_experts else None)
            self._emitted(seq, outputs)
            if step.reserved_lookahead and not seq.is_finished:
                self.block_manager.free_lookahead_blocks(seq)
        return outputs

    def _emitted(self, seq: Sequence, outputs: list[SequenceOutput]) -> None:
        """The host appended a token to `seq`: share its full blocks, check its stops, report it."""
        self.block_manager.register_computed_blocks(seq)
        self.num_generation_tokens += 1
        out = self._postprocess(seq)
        if out is not None:
            outputs.append(out)

    def _postprocess(self, seq: Sequence) -> SequenceOutput | None:
        params, token = seq.params, seq.token_ids[-1]
        new_text = ""
        if seq.incremental or params.stop:  # text is needed now, to stream it or to look for stop strings
            new_text = seq.detokenizer.push(seq.completion_token_ids)
            seq.text += new_text
        stopped_by_token = (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids
        stopped_by_string = (not stopped_by_token and bool(params.stop) and bool(new_text)
                             and self._cut_at_stop_string(seq, len(new_text)))
        reason = None
        if stopped_by_token or stopped_by_string:
            reason = "stop"
        elif seq.num_completion_tokens >= params.max_tokens:
            reason = "length"
        if reason is not None:
            if not stopped_by_string:  # past a stop string, the held-back text is cut anyway
                seq.text += seq.detokenizer.flush(seq.completion_token_ids)
            self.scheduler.finish(seq, reason)
            if all(s.is_finished for s in self.requests.get(seq.request_id, [])):
                del self.requests[seq.request_id]
        if not seq.incremental:
            if reason is None:
                return None
            return SequenceOutput(seq.request_id, seq.index, seq.completion_token_ids, seq.logprobs, seq.top_logprobs,
                                  seq.text, reason, seq.oldest_weight_version, seq.routed_experts,
                                  num_draft_tokens=seq.num_draft_tokens, num_accepted_tokens=seq.num_accepted_tokens)
        held = 0 if reason is not None or not params.stop else max(map(len, params.stop)) - 1
        end = max(seq.num_text_sent, len(seq.text) - held)
        text, seq.num_text_sent = seq.text[seq.num_text_sent:end], end
        return SequenceOutput(seq.request_id, seq.index, [token], [seq.logprobs[-1]], [seq.top_logprobs[-1]],
                              text, reason, seq.oldest_weight_version, seq.routed_experts[-1:],
                              num_draft_tokens=seq.num_draft_tokens, num_accepted_tokens=seq.num_accepted_tokens)

    def _cut_at_stop_string(self, seq: Sequence, num_new_chars: int) -> bool:
        """Cut `seq.text` at the first stop string that the new text completes."""
        stops = seq.params.stop
        start = max(0, len(seq.text) - num_new_chars - max(map(len, stops)) + 1)
        found = [(pos, s) for s in stops if (pos := seq.text.find(s, start)) >= 0]
        if not found:
            return False
        pos, stop = min(found)
        seq.text = seq.text[:pos + (len(stop) if seq.params.include_stop_str_in_output else 0)]
        return True

    def update_weights(self, state: dict[str, torch.Tensor], version: int | None = None, lora: LoraSpec | None = None) -> int:
        """Load HF-named tensors into the live model, or with `engine.lora` merge LoRA adapters into the kept base
        (`lora`: the adapters' own spec, where their folder says it); on any mismatch nothing is changed. The
        tensors of MTP layers the model was built without are passed over (`multi_token.without_left_out_layers`)."""
        state = without_left_out_layers(self.weight_target, state)
        with_adapters = any(is_adapter_name(name) for name in state)
        if self.adapters is not None:
            served = self.adapters.spec
            if lora is not None and (lora.rank, lora.alpha) != (served.rank, served.alpha):
                raise ValueError(f"adapters of rank {lora.rank} and alpha {lora.alpha}; this server merges rank "
                                 f"{served.rank} and alpha {served.alpha} (`engine.lora`)")
            if not with_adapters:
                raise KeyError("this server's policy is LoRA adapters on a fixed base (`engine.lora.enabled`): an update "
                               "holds adapters only, not full weights")
            self.adapters.apply(state)
        elif with_adapters:
            raise KeyError("LoRA adapters sent to a server of full weights: set `engine.lora.enabled` (`tandem rl` does "
                           "when `trainer.lora.enabled` is set)")
        else:
            load_weights_into(self.weight_target, state)  # checks every name and shape before copying
        self.weight_version = self.weight_version + 1 if version is None else version
        self.block_manager.reset_prefix_cache()
        return self.weight_version

    def kv_bytes(self, num_blocks: int) -> int:
        """The bytes of `num_blocks` of this engine's KV cache: what a hand-off of them moves."""
        return num_blocks * self.block_manager.block_size * self.runner.cache.bytes_per_token

    def stats(self) -> EngineStats:
        """Counters for /metrics; plain reads, safe (if a step stale) from another thread."""
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.block_manager.usage,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            weight_version=self.weight_version,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
        )
