"""The SFT warm-up `tandem rl` runs when the RL starting model does not exist yet.

Three idempotent steps, each skipped when its output exists: the base model
(`tandem model init`), the SFT data (an environment's `sft_examples`), the SFT run itself.

The SFT folder (`output_dir` of `warmup.sft`) follows the rule of `tandem.config.run_folder`: a finished
warm-up (`weights/final` complete) is never run again, its result is the starting model; an unfinished one
is continued from its newest complete checkpoint, or, without one, started over under `tandem rl --clean`
and refused otherwise. `plan_warmup` decides that before anything is written or started.
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tandem.config.resolve import warmup_sft
from tandem.config.rl import RLConfig
from tandem.config.run_folder import remove_run, results_in
from tandem.config.sft import SFTConfig
from tandem.launch.process import ManagedProcess, RunFailed
from tandem.launch.resume import cut_run_records
from tandem.monitor.metrics import read_metrics
from tandem.monitor.progress import MetricsFollower, StepBar
from tandem.monitor.stop_signals import held_signals
from tandem.transport.files import atomic_write_text
from tandem.transport.paths import complete_checkpoint_steps, final_weights_dir, is_stable


@dataclass(frozen=True)
class WarmupPlan:
    sft: SFTConfig
    resume_step: int | None = None
    """The SFT run's checkpoint to continue from; None: the SFT starts at step 0."""
    start_over: bool = False
    """Remove the unfinished SFT run of the folder first (`tandem rl --clean`)."""


def plan_warmup(config: RLConfig) -> WarmupPlan | None:
    """What the warm-up does, decided from the SFT folder before anything starts; None when the starting
    model exists (or no warm-up is set). RunFailed for a folder the warm-up may not write into."""
    if Path(config.model.name).expanduser().exists() or config.warmup.sft is None:
        return None
    sft = warmup_sft(config)
    folder = sft.run_dir
    if is_stable(final_weights_dir(folder)):  # finished, but not at `model.name` (`weights/step_<max_steps>` of a longer run)
        raise RunFailed(f"the warm-up's SFT run in {folder} has finished without writing the starting model "
                        f"{config.model.name}: start from {final_weights_dir(folder)}, or remove the folder to run it again")
    if not results_in(folder):
        return WarmupPlan(sft)
    checkpoints = complete_checkpoint_steps(folder, "trainer")
    if checkpoints:
        return WarmupPlan(sft, resume_step=checkpoints[-1])
    if config.clean:
        return WarmupPlan(sft, start_over=True)
    done = max((r["step"] for r in read_metrics(folder, "sft")), default=0)
    raise RunFailed(f"the warm-up's SFT folder {folder} holds an unfinished run (step {done} of {sft.max_steps}, no "
                    "complete checkpoint to continue from): pass --clean to start the warm-up over, or remove the folder")


def run_warmup(config: RLConfig, plan: WarmupPlan, log: logging.Logger) -> None:
    warmup, sft, sft_file = config.warmup, plan.sft, str(config.warmup.sft)
    log.info("starting model %s does not exist: running the SFT warm-up %s first", config.model.name, sft_file)
    base = Path(sft.model.name)
    if not (base / "config.json").is_file() and warmup.base_preset:  # written last: a folder without it is unfinished
        from tandem.models.presets import init_model

        log.info("warm-up: creating the base model %s (preset %s)", base, warmup.base_preset)
        init_model(warmup.base_preset, base, seed=config.seed)
    data_path = Path(sft.data.path)
    if not data_path.exists() and warmup.data_env:
        log.info("warm-up: writing %d SFT examples of %s to %s", warmup.num_examples, warmup.data_env, data_path)
        try:
            write_sft_data(warmup.data_env, data_path, warmup.num_examples, warmup.num_eval_examples, warmup.data_args)
        except (ValueError, TypeError) as err:  # too many examples asked, an argument sft_examples does not take
            raise RunFailed(f"warm-up data (`warmup.data_env`, `warmup.num_examples`, `warmup.num_eval_examples`, "
                            f"`warmup.data_args`): {err}") from None
    argv = [sys.executable, "-m", "tandem.cli", "sft", "@", sft_file]
    if plan.start_over:
        log.info("warm-up: removing the unfinished SFT run in %s (--clean)", sft.run_dir)
        remove_run(sft.run_dir)
    if plan.resume_step is not None:
        removed = cut_run_records(sft.run_dir, plan.resume_step)
        log.info("warm-up: continuing the SFT run in %s after step %d%s", sft.run_dir, plan.resume_step,
                 f"; removed its later records: {', '.join(removed)}" if removed else "")
        argv += ["--ckpt.resume", "true", "--ckpt.resume-step", str(plan.resume_step)]
    log_path = config.run_dir / "logs" / "sft.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")} | {"PYTHONUNBUFFERED": "1"}
    log.info("warm-up: SFT log in %s", log_path)
    proc = None
    try:
        with held_signals():  # no signal between the start and `proc`: the stop below reaches every process started
            proc = ManagedProcess("sft", argv, log_path, env)
        code = _wait_showing_steps(proc, sft.run_dir, sft.max_steps)
    finally:
        with held_signals():
            if proc is not None:
                proc.stop()
    if code != 0:
        tail = "\n".join(f"  | {line}" for line in proc.tail(20))
        raise RunFailed(f"the sft warm-up failed (exit code {code}); last lines of {log_path}:\n{tail}")
    if not Path(config.model.name).exists():
        raise RunFailed(f"the SFT warm-up finished but did not write the starting model {config.model.name}; check `model.name` against the SFT output")


def _wait_showing_steps(proc: ManagedProcess, run_dir: Path, max_steps: int) -> int:
    """Wait for the SFT process, showing its steps (from its `metrics.jsonl`) as a progress bar."""
    metrics, bar = MetricsFollower(run_dir), StepBar("sft", max_steps)
    try:
        while proc.poll() is None:
            steps = [r["step"] for r in metrics.new_records() if r.get("process") == "sft" and "loss" in r]
            bar.update(max(steps, default=0))
            time.sleep(0.5)
    finally:
        bar.close()
    return proc.wait()


def write_sft_data(env_id: str, path: Path, num_examples: int, num_eval_examples: int, data_args: dict) -> None:
    """Write `path` (train) and `eval.jsonl` beside it from the environment's `sft_examples`."""
    from tandem.envs.registry import BUILTIN_ENVIRONMENTS

    name = env_id.replace("-", "_")
    module = importlib.import_module(BUILTIN_ENVIRONMENTS.get(name, name))
    if not hasattr(module, "sft_examples"):
        raise ValueError(f"environment {env_id!r} has no sft_examples(); give the SFT config a data.path that exists")
    total = num_examples + num_eval_examples
    if "progress" in inspect.signature(module.sft_examples).parameters:  # slow writers (code_fix's sandboxed runs) show a bar
        bar = StepBar("warm-up data", total, unit="example")
        try:
            rows = module.sft_examples(total, **data_args, progress=bar.update)
        finally:
            bar.close()
    else:
        rows = module.sft_examples(total, **data_args)
    train, held_out = rows[:num_examples], rows[num_examples:]
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in train))
    atomic_write_text(path.with_name("eval.jsonl"), "".join(json.dumps(r) + "\n" for r in held_out))
