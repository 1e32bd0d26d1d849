"""The trainer's preflight mode (`tandem trainer-preflight @ trainer.toml`, run by `tandem rl` before step 1).

It builds the policy exactly as training will (same config, ranks, devices, dtype, kernels), reads the
orchestrator's probe batch (`preflight/probe/rank_R.msgpack`: the inference server's samples, logprobs
included, packed as a step is), recomputes their logprobs with the run's objective and
writes `preflight/trainer.json` (rank 0): mismatch KL, tokens/s and the trainer's memory plan. It never
steps the optimizer and never publishes: the run then starts from the same state.

The mismatch KL is measured here, by the trainer's own forward, rather than by the model code in the
launcher: the trainer's blocks, compilation and mixed precision are what training will use, so they are
what must agree with the server.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch

from tandem.config.trainer import RolloutDataConfig, TrainerConfig
from tandem.models.loading import resolve_dtype
from tandem.trainer.micro_batch import MicroBatch
from tandem.trainer.data import BatchError, check_step_batch, fake_batch
from tandem.trainer.loss import build_loss
from tandem.trainer.rl.train import kl_metrics, rl_objective
from tandem.trainer.session import Session, open_session, peak_memory_gib
from tandem.trainer.step import accumulate_gradients
from tandem.transport.files import atomic_write_text
from tandem.transport.paths import preflight_trainer_report, probe_file
from tandem.transport.types import decode_batch

OPTIMIZER_STATES = {"adamw": 2, "sgd": 1}
"""fp32 tensors of optimizer state per parameter (AdamW: two moments; SGD: momentum, when > 0)."""


def probe_logprobs(config: TrainerConfig, session: Session) -> dict[str, Any]:
    """Mismatch KL and tokens/s of the probe batch, through the run's objective (no optimizer step)."""
    dims = session.dims
    path = probe_file(config.run_dir, dims.rank)
    batch = decode_batch(path.read_bytes())
    check_step_batch(batch, config.seq_len, session.vocab_size, str(path), dims)
    micro_batches = [MicroBatch.from_row(row, dims.device, policy_version=0) for row in batch.rows]
    start = time.perf_counter()
    grads = accumulate_gradients(session.model, micro_batches, rl_objective(build_loss(config.loss)), batch.num_loss_tokens,
                                 0.0, dims)
    seconds = time.perf_counter() - start
    session.model.zero_grad(set_to_none=True)
    num_tokens = sum(len(row.input_ids) for row in batch.rows) * dims.world_size
    return {"mismatch_kl": kl_metrics(grads.metrics)["mismatch_kl"], "num_loss_tokens": batch.num_loss_tokens,
            "num_tokens": num_tokens, "train_tokens_per_s": num_tokens / max(seconds, 1e-9)}


def memory_plan(config: TrainerConfig, session: Session) -> dict[str, Any]:
    """This rank's memory in GiB: weights, gradients and optimizer state (counted from its shards), the
    activations of one full row of `seq_len` tokens (measured on CUDA), against the device (host on CPU)."""
    dims = session.dims
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in session.model.parameters())
    bytes_per_param = next(session.model.parameters()).element_size()
    momentum = getattr(config.optim, "momentum", 1.0) > 0
    states = OPTIMIZER_STATES[config.optim.type] if momentum else 0
    gib = 2**30
    plan = {"weights": local * bytes_per_param / gib, "gradients": local * bytes_per_param / gib,
            "optimizer": local * 4 * states / gib}
    row = fake_batch(0, dims.rank, dims.world_size, RolloutDataConfig(fake_rows=dims.world_size), config.seq_len,
                     session.vocab_size, config.seed)
    micro_batches = [MicroBatch.from_row(r, dims.device) for r in row.rows]
    on_cuda = dims.device.type == "cuda"
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(dims.device)
        before = torch.cuda.memory_allocated(dims.device)
    accumulate_gradients(session.model, micro_batches, rl_objective(build_loss(config.loss)), row.num_loss_tokens, 0.0, dims)
    session.model.zero_grad(set_to_none=True)
    if on_cuda:
        plan["activations"] = (torch.cuda.max_memory_allocated(dims.device) - before) / gib
        plan["device_total"] = torch.cuda.mem_get_info(dims.device)[1] / gib
    else:  # the CPU has no allocator statistics: the process's peak resident memory stands for the whole plan
        plan["activations"] = None
        plan["process_peak"] = peak_memory_gib(dims.device)
        plan["device_total"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / gib
    plan["planned"] = sum(v for k, v in plan.items() if k in ("weights", "gradients", "optimizer", "activations") and v)
    return plan


def main(config: TrainerConfig) -> int:
    from tandem.monitor.logging import setup_logging

    # The server starts from `model.name` (a resumed run's orchestrator loads the newer policy only later):
    # the preflight compares the two on that model, never on a checkpoint.
    config = config.model_copy(update={"ckpt": config.ckpt.model_copy(update={"resume": False})})
    try:
        session = open_session(config, "trainer")
    except (FileNotFoundError, KeyError, ValueError) as err:
        setup_logging("trainer").error("cannot start the trainer's preflight: %s", err)
        return 1
    try:
        report = {**probe_logprobs(config, session), "device": str(session.dims.device),
                  "dtype": str(resolve_dtype(config.model.dtype, session.dims.device)).removeprefix("torch."),
                  "world_size": session.dims.world_size, "memory": memory_plan(config, session)}
        if session.dims.is_main:
            atomic_write_text(preflight_trainer_report(config.run_dir), json.dumps(report, indent=1))
    except BatchError as err:
        session.log.error("bad probe batch: %s", err)
        return 1
    finally:
        session.close()
    return 0
