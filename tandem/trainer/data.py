"""The RL trainer's input: the orchestrator's batch files, checked, or fake batches.

Step N (1-indexed) waits for `rollouts/step_N/rank_R.msgpack` (written atomically by the
orchestrator, so a file that exists is complete). Every row is checked against the rules of
`tandem.transport.types` before any compute, and a bad batch stops the trainer with an error
naming the file, row and field: training on a misaligned batch would silently produce garbage.

Fake batches are a function of (seed, step, global row index) only, so they are the same rows
whatever the world size: a 2-rank run trains on exactly the rows of a 1-rank run, split in two.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import msgspec
import torch

from tandem.config.trainer import RolloutDataConfig
from tandem.trainer.parallel.dims import ParallelDims
from tandem.trainer.step import global_sum
from tandem.transport.paths import rollout_file
from tandem.transport.types import PackedRow, TrainingBatch, decode_batch


class BatchError(ValueError):
    """A batch that breaks the wire format's rules; the message names what is wrong."""


def wait_for_batch(run_dir: Path, step: int, rank: int, poll_interval_s: float, timeout_s: float | None) -> TrainingBatch:
    """Poll for this rank's file of `step`, then read it."""
    path = rollout_file(run_dir, step, rank)
    start = time.monotonic()
    while not path.is_file():
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            raise BatchError(f"no batch for step {step} after {timeout_s:g} s: {path} does not exist (is the orchestrator running?)")
        time.sleep(poll_interval_s)
    try:
        batch = decode_batch(path.read_bytes())
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        raise BatchError(f"{path}: not a TrainingBatch: {err}") from None
    if batch.step != step or batch.rank != rank:
        raise BatchError(f"{path}: holds step {batch.step} rank {batch.rank}, expected step {step} rank {rank}")
    return batch


def check_batch(batch: TrainingBatch, seq_len: int, vocab_size: int, source: str, router_replay: bool = False) -> None:
    """Raise `BatchError` on the first row that breaks the alignment rules (`router_replay`: rows with loss
    tokens must carry routed experts)."""
    if not batch.rows:
        raise BatchError(f"{source}: the batch has no rows (pad with all-zero loss_mask rows instead)")
    for i, row in enumerate(batch.rows):
        where = f"{source}: row {i}"
        n = len(row.input_ids)
        lengths = {f: len(getattr(row, f)) for f in ("position_ids", "loss_mask", "logprobs", "advantages", "temperatures")}
        bad = {f: m for f, m in lengths.items() if m != n}
        if bad:
            raise BatchError(f"{where}: {n} input_ids but {', '.join(f'{m} {f}' for f, m in bad.items())}")
        if n < 2 or n > seq_len:
            raise BatchError(f"{where}: {n} tokens; rows hold 2 to seq_len = {seq_len} tokens")
        if min(row.input_ids) < 0 or max(row.input_ids) >= vocab_size:
            raise BatchError(f"{where}: token ids must lie in [0, {vocab_size}) (the model's vocab_size)")
        if row.position_ids[0] != 0:
            raise BatchError(f"{where}: position_ids must start at 0 (a row starts with a sample)")
        starts = [t for t, p in enumerate(row.position_ids) if p == 0]
        if any(row.loss_mask[t] for t in starts):
            raise BatchError(f"{where}: loss_mask is 1 on the first token of a sample, which nothing predicts")
        if any(m not in (0, 1) for m in row.loss_mask):
            raise BatchError(f"{where}: loss_mask values must be 0 or 1")
        if any(not (t > 0 and math.isfinite(t)) for t, m in zip(row.temperatures, row.loss_mask) if m):
            raise BatchError(f"{where}: temperatures of loss tokens must be finite and > 0 (logprobs of log_softmax(logits / T))")
        for name in ("logprobs", "advantages"):
            if not all(math.isfinite(v) for v in getattr(row, name)):
                raise BatchError(f"{where}: {name} must be finite")
        check_routed_experts(row, where, router_replay)


def check_routed_experts(row: PackedRow, where: str, router_replay: bool) -> None:
    if row.routed_experts and len(row.routed_experts) != len(row.input_ids):
        raise BatchError(f"{where}: {len(row.input_ids)} input_ids but {len(row.routed_experts)} routed_experts")
    shapes = {(len(r), len(r[0])) for r in row.routed_experts if r}
    if len(shapes) > 1:
        raise BatchError(f"{where}: routed_experts of different [layers, k] shapes {sorted(shapes)}")
    if router_replay and any(row.loss_mask) and not shapes:
        raise BatchError(f"{where}: `loss.router_replay` = true but the row carries no routed experts: set "
                         "`orchestrator.sampling.return_routed_experts = true` (tandem's engine, a mixture-of-experts model)")


def check_step_batch(batch: TrainingBatch, seq_len: int, vocab_size: int, source: str, dims: ParallelDims,
                     router_replay: bool = False) -> None:
    """Collective check of one step's batch: every rank raises if any rank's batch is bad.

    Beyond the per-row rules, every rank must have the same number of rows (FSDP runs one
    forward/backward per row in lockstep) and `num_loss_tokens` must be the true global count.
    """
    try:
        check_batch(batch, seq_len, vocab_size, source, router_replay)
        error = ""
    except BatchError as err:
        error = str(err)
    rows = len(batch.rows)
    local_tokens = sum(sum(row.loss_mask) for row in batch.rows)
    num_bad, total_rows, total_sq, total_tokens = global_sum([float(bool(error)), rows, rows * rows, local_tokens], dims)
    if num_bad:
        raise BatchError(error or f"{int(num_bad)} other rank(s) received a bad batch for step {batch.step}")
    if total_sq * dims.world_size != total_rows * total_rows:  # equal iff every rank has the same count
        raise BatchError(f"{source}: ranks received different numbers of rows (this rank: {rows}); FSDP needs the same number on every rank")
    if int(total_tokens) != batch.num_loss_tokens:
        raise BatchError(f"{source}: num_loss_tokens = {batch.num_loss_tokens} but the loss masks of all ranks hold {int(total_tokens)} loss tokens")


def fake_batch(step: int, rank: int, world_size: int, config: RolloutDataConfig, seq_len: int, vocab_size: int, seed: int) -> TrainingBatch:
    """Random rows: `fake_samples_per_row` samples per row, each half prompt, half completion."""
    if config.fake_rows % world_size:
        raise BatchError(f"`data.fake_rows` = {config.fake_rows} is not a multiple of the world size {world_size}")
    per_rank = config.fake_rows // world_size
    sample_len = seq_len // config.fake_samples_per_row
    prompt_len = sample_len // 2
    # The logprob of a uniform policy: about what a freshly initialized model assigns.
    uniform_logprob = -math.log(vocab_size)
    rows = []
    for g in range(rank * per_rank, (rank + 1) * per_rank):
        gen = torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_000_003 + g)
        ids = torch.randint(0, vocab_size, (config.fake_samples_per_row * sample_len,), generator=gen)
        advantages = torch.randn(config.fake_samples_per_row, generator=gen)
        positions, mask, adv = [], [], []
        for s in range(config.fake_samples_per_row):
            positions += list(range(sample_len))
            mask += [0] * prompt_len + [1] * (sample_len - prompt_len)
            adv += [0.0] * prompt_len + [float(advantages[s])] * (sample_len - prompt_len)
        logprobs = [uniform_logprob * m for m in mask]
        rows.append(PackedRow(ids.tolist(), positions, mask, logprobs, adv, [1.0] * len(ids)))
    num_loss_tokens = config.fake_rows * config.fake_samples_per_row * (sample_len - prompt_len)
    return TrainingBatch(step=step, rank=rank, rows=rows, num_loss_tokens=num_loss_tokens)
