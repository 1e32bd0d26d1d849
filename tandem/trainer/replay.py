"""`tandem replay RUN_DIR --step N`: recompute the trainer's loss and metrics of one step offline.

Inputs, all from the run folder: the trainer config (`configs/trainer.toml`), the step's batch files
(`rollouts/step_N/rank_R.msgpack`, every rank's rows in one process) and the policy step N trained,
`weights/step_{N-1}/` (the run's `model.name` for step 1; `weights.keep_every` keeps folders for this).
The step runs through the trainer's own code (`open_session`, `accumulate_gradients`, `rl_objective`)
without the optimizer update, once with the run's loss and once with `--loss.*` when given, so the two
treat the same tokens on the same weights.

Exactness: replaying a run of one trainer rank whose published dtype is its master dtype (fp32 on the CPU)
repeats the same operations in the same order on the same values, so loss and gradient norm equal the
logged ones bitwise (`tests/trainer/test_replay.py`). A run of R ranks is replayed on one: the
per-rank float64 sums and the FSDP gradient reduction add in another order, so they can only agree to
rounding, not bitwise (not tested yet).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from tandem.config.replay import ReplayConfig, read_run_trainer_config
from tandem.config.trainer import LossConfig, TrainerCheckpointConfig, TrainerConfig
from tandem.models.lora import read_adapter_folder
from tandem.monitor.metrics import read_metrics
from tandem.trainer.micro_batch import MicroBatch
from tandem.trainer.data import BatchError, check_batch
from tandem.trainer.loss import build_loss
from tandem.trainer.model import TokenLogprobs, load_shards
from tandem.trainer.rl.train import kl_metrics, rl_objective
from tandem.trainer.session import Session, open_session
from tandem.trainer.step import Objective, accumulate_gradients
from tandem.transport.files import atomic_write_text
from tandem.transport.paths import is_stable, rollouts_dir, weights_dir
from tandem.transport.types import TrainingBatch, decode_batch


def read_step_batches(run_dir: Path, step: int) -> list[TrainingBatch]:
    """Every rank's batch file of `step`, in rank order."""
    folder = rollouts_dir(run_dir, step)
    files = sorted(folder.glob("rank_*.msgpack"), key=lambda p: int(re.sub(r"\D", "", p.stem)))
    if not files:
        raise FileNotFoundError(f"{folder} holds no rank_R.msgpack: step {step} of this run has no recorded batch")
    return [decode_batch(p.read_bytes()) for p in files]


def policy_folder(run: TrainerConfig, run_dir: Path, step: int) -> str:
    """The weights step N trained: `weights/step_{N-1}/`, or the run's starting model for step 1."""
    if step == 1:
        return run.model.name
    folder = weights_dir(run_dir, step - 1)
    if not is_stable(folder):
        raise FileNotFoundError(f"{folder} is missing (pruned by `weights.keep` = {run.weights.keep}, or never published at "
                                f"`weights.interval` = {run.weights.interval}): replaying step {step} needs it; set "
                                "`trainer.weights.keep_every` in the run to keep such folders")
    return str(folder)


def replay_session(config: ReplayConfig, run: TrainerConfig) -> Session:
    """The run's model, built as the trainer builds it, on the weights step N started from (a LoRA run's base, with
    the adapters of that folder)."""
    policy = policy_folder(run, config.run_dir, config.step)
    model = run.model if run.lora.enabled else run.model.model_copy(update={"name": policy})
    replay = run.model_copy(update={"model": model, "device": config.device, "output_dir": config.run_dir,
                                    "ckpt": TrainerCheckpointConfig(enabled=False)})
    session = open_session(replay, "replay")
    if run.lora.enabled and config.step > 1:
        _, adapters = read_adapter_folder(Path(policy))
        load_shards(session.model, adapters, policy, session.model.adapter_parameters())
    return session


def recording(objective: Objective, log_ratios: list[torch.Tensor]) -> Objective:
    """`objective`, also keeping log(pi_theta / mu) of every loss token."""

    def wrapped(mb: MicroBatch, out: TokenLogprobs):
        log_ratios.append((out.logprobs - mb.inference_logprobs)[mb.loss_mask].detach().double())
        return objective(mb, out)

    return wrapped


def replay_loss(session: Session, micro_batches: list[MicroBatch], num_loss_tokens: int, loss: LossConfig,
                max_grad_norm: float, log_ratios: list[torch.Tensor] | None = None) -> dict[str, Any]:
    """Loss, gradient norm and metrics of the step under `loss`; the gradients are dropped."""
    objective = rl_objective(build_loss(loss))
    if log_ratios is not None:
        objective = recording(objective, log_ratios)
    router = session.model.router
    if router is not None:
        router.begin_step(len(micro_batches))
    grads = accumulate_gradients(session.model, micro_batches, objective, num_loss_tokens, 0.0, session.dims)
    session.model.zero_grad(set_to_none=True)
    if router is not None:
        router.end_step(update_bias=False)
    grad_norm = float(grads.grad_norm)
    clip = min(1.0, max_grad_norm / grad_norm) if max_grad_norm > 0 and grad_norm > 0 else 1.0
    return {"loss_type": loss.type, "loss": grads.loss, "grad_norm": grad_norm, "clip_coef": clip,
            **kl_metrics(grads.metrics), **grads.metrics}


def ratio_summary(log_ratios: list[torch.Tensor]) -> dict[str, float]:
    """How far the recomputed policy is from the sampler on the step's loss tokens."""
    r = torch.cat(log_ratios).exp() if log_ratios else torch.ones(1, dtype=torch.float64)
    return {"ratio_mean": float(r.mean()), "ratio_min": float(r.min()), "ratio_max": float(r.max()),
            "ratio_outside_0.8_1.2": float(((r < 0.8) | (r > 1.2)).double().mean())}


def logged_step(run_dir: Path, step: int) -> dict[str, Any] | None:
    """The trainer's metrics of `step` as the run logged them (the last line wins after a resume)."""
    records = [r for r in read_metrics(run_dir, "trainer") if r.get("step") == step]
    return records[-1] if records else None


def replay(config: ReplayConfig) -> dict[str, Any]:
    run = read_run_trainer_config(config.run_dir)
    batches = read_step_batches(config.run_dir, config.step)
    session = replay_session(config, run)
    try:
        micro_batches = []
        for batch in batches:
            check_batch(batch, run.seq_len, session.vocab_size, f"step {config.step} rank {batch.rank}", run.loss.router_replay)
            micro_batches += [MicroBatch.from_row(row, session.dims.device, policy_version=config.step - 1,
                                                  router_replay=run.loss.router_replay) for row in batch.rows]
        num_loss_tokens = batches[0].num_loss_tokens
        log_ratios: list[torch.Tensor] = []
        result = {"step": config.step, "num_ranks": len(batches), "num_loss_tokens": num_loss_tokens,
                  "logged": logged_step(config.run_dir, config.step),
                  "run": replay_loss(session, micro_batches, num_loss_tokens, run.loss, run.optim.max_grad_norm, log_ratios)}
        result["ratios"] = ratio_summary(log_ratios)
        if config.loss is not None:
            result["alternative"] = replay_loss(session, micro_batches, num_loss_tokens, config.loss, run.optim.max_grad_norm)
    finally:
        session.close()
    return result


def format_report(result: dict[str, Any]) -> str:
    """A short table: logged vs replayed, and the alternative loss beside the run's."""
    logged = result["logged"] or {}
    columns = ["logged", "replayed"] + (["alternative"] if "alternative" in result else [])
    keys = [k for k in dict.fromkeys([*result["run"], *result.get("alternative", {})]) if k != "loss_type"]
    lines = [f"step {result['step']}: {result['num_loss_tokens']} loss tokens from {result['num_ranks']} rank file(s); "
             f"loss {result['run']['loss_type']}" + (f", alternative {result['alternative']['loss_type']}" if "alternative" in result else ""),
             f"{'':<22}" + "".join(f"{c:>24}" for c in columns)]
    for key in keys:
        values = [logged.get(key), result["run"].get(key)] + ([result["alternative"].get(key)] if "alternative" in result else [])
        lines.append(f"{key:<22}" + "".join(f"{'-' if v is None else repr(v):>24}" for v in values))
    for key, value in result["ratios"].items():
        lines.append(f"{key:<22}{value!r:>48}")
    if logged:
        same = logged.get("loss") == result["run"]["loss"] and logged.get("grad_norm") == result["run"]["grad_norm"]
        lines.append("loss and grad_norm " + ("equal the logged values bitwise" if same else "differ from the logged values"))
    return "\n".join(lines)


def main(config: ReplayConfig) -> int:
    from tandem.monitor.logging import setup_logging

    try:
        result = replay(config)
    except (FileNotFoundError, BatchError, ValueError) as err:
        setup_logging("replay").error("cannot replay: %s", err)
        return 1
    out = config.run_dir / "replay" / f"step_{config.step}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(result, indent=1))
    print(format_report(result))
    print(f"saved {out}")
    return 0
