"""The SFT warm-up `tandem rl` runs when the RL starting model does not exist yet.

Three idempotent steps, each skipped when its output exists: the base model
(`tandem model init`), the SFT data (an environment's `sft_examples`), the SFT run itself.
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import os
import sys
import time
from pathlib import Path

from tandem.config.loader import ConfigError, parse_args
from tandem.config.rl import RLConfig
from tandem.launch.process import ManagedProcess, RunFailed
from tandem.monitor.progress import MetricsFollower, StepBar
from tandem.transport.files import atomic_write_text


def run_warmup(config: RLConfig, log: logging.Logger) -> None:
    from tandem.config.sft import SFTConfig

    warmup = config.warmup
    sft_file = str(warmup.sft)
    try:
        sft = parse_args(SFTConfig, ["@", sft_file], environ={})
    except ConfigError as err:
        raise RunFailed(f"warm-up SFT config {sft_file}: {err}") from None
    log.info("starting model %s does not exist: running the SFT warm-up %s first", config.model.name, sft_file)
    base = Path(sft.model.name)
    if not base.exists() and warmup.base_preset:
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
    log_path = config.run_dir / "logs" / "sft.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")} | {"PYTHONUNBUFFERED": "1"}
    proc = ManagedProcess("sft", [sys.executable, "-m", "tandem.cli", "sft", "@", sft_file], log_path, env)
    log.info("warm-up: SFT log in %s", log_path)
    try:
        code = _wait_showing_steps(proc, sft.run_dir, sft.max_steps)
    finally:
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
