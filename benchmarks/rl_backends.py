"""`tandem rl` reverse-text on one GPU with one inference backend, engine and trainer sharing GPU 0
(issue 17: vLLM beside tandem's engine; run once per backend and compare the summaries).

    PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 \
        python benchmarks/rl_backends.py --backend vllm --out $OUT/rl-vllm

Runs `tandem rl @ examples/reverse_text/rl.toml` with `deployment.type = "gpu"`,
`deployment.trainer_devices = [0]` (the engine then takes `deployment.shared_gpu_memory_fraction`),
`inference.backend = BACKEND` and the filesystem weight transport (the only one for a shared GPU:
NCCL runs one rank per device). The SFT warm-up runs first when its model is missing
(`outputs/reverse-text/sft`, shared by both backends' runs). The run folder stays in a temporary
directory; `--out` receives `summary.json` (eval reward per evaluated step, mean mismatch KL,
median step time, wall time, exit code), `metrics.jsonl`, the logs, the preflight report and the
resolved configs. Past `--timeout-s` the run is stopped as by Ctrl-C and recorded as timed out.
`--exact` runs it with `run.exact = true` (issue 20: every step with on-policy tokens must log mismatch KL 0;
the summary keeps the largest); `--model DIR` starts from a carried model instead of the warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import source_commit

REPO = Path(__file__).resolve().parents[1]
LOADED = re.compile(r"loaded policy \d+ into \d+ server\(s\) in ([\d.]+)s")
"""The orchestrator's log line for each policy it loaded (`orchestrator/policy.py`, `WeightWatcher.load_next`)."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["tandem", "vllm"], required=True)
    parser.add_argument("--max-steps", type=int, default=40, help="RL steps (evals at 0, every 25 and at the last)")
    parser.add_argument("--exact", action="store_true", help="`run.exact = true` (issue 20): on-policy mismatch KL must be 0")
    parser.add_argument("--model", help="start RL from this model folder instead of the example's SFT warm-up")
    parser.add_argument("--timeout-s", type=float, default=540.0)
    parser.add_argument("--out", required=True, help="folder for the summary and the run's logs")
    parser.add_argument("--commit", help="the commit measured (default: git's HEAD)")
    return parser.parse_args()


def run_rl(args: argparse.Namespace, run_dir: Path) -> tuple[int | str, float]:
    """The launcher's exit code ("timeout" past `--timeout-s`) and its wall time."""
    argv = [sys.executable, "-m", "tandem.cli", "rl", "@", "examples/reverse_text/rl.toml", "--deployment.type", "gpu",
            "--deployment.trainer_devices", "[0]", "--inference.backend", args.backend, "--max_steps", str(args.max_steps),
            "--output_dir", str(run_dir)]
    argv += ["--run.exact", "true"] if args.exact else []
    argv += ["--model.name", args.model] if args.model else []
    start = time.monotonic()
    launcher = subprocess.Popen(argv, cwd=REPO)
    try:
        return launcher.wait(timeout=args.timeout_s), time.monotonic() - start
    except subprocess.TimeoutExpired:
        launcher.send_signal(signal.SIGINT)  # the launcher tears its processes down on Ctrl-C
        try:
            launcher.wait(timeout=90)
        except subprocess.TimeoutExpired:
            launcher.kill()
        return "timeout", time.monotonic() - start


def summarize(run_dir: Path) -> dict:
    """Eval reward per evaluated step, the trainer's mean mismatch KL and median publish time, the orchestrator's
    median step time and median time to load a policy into the server (from its log)."""
    metrics_file, log = run_dir / "metrics.jsonl", run_dir / "logs" / "orchestrator.log"
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.exists() else []
    loads = [float(s) for s in LOADED.findall(log.read_text(errors="replace"))] if log.exists() else []
    publish_s = [row["time_publish"] for row in rows if row.get("time_publish") is not None]
    evals = {row["step"]: row["eval/reward_mean"] for row in rows if row.get("eval/reward_mean") is not None}
    trainer_steps = [row for row in rows if row.get("process") == "trainer" and "loss" in row]
    kls = [row["mismatch_kl"] for row in trainer_steps if row.get("mismatch_kl") is not None]
    step_s = [row["time/step_s"] for row in rows if row.get("time/step_s") is not None]
    return {"eval_reward_by_step": evals, "mismatch_kl_mean": statistics.fmean(kls) if kls else None,
            "mismatch_kl_max": max(kls) if kls else None,
            "num_trainer_steps": len(trainer_steps), "num_steps_with_on_policy_tokens": len(kls), "step_s_median": statistics.median(step_s) if step_s else None,
            "num_orchestrator_steps": len(step_s), "publish_s_median": statistics.median(publish_s) if publish_s else None,
            "policy_load_s_median": statistics.median(loads) if loads else None, "num_policy_loads": len(loads)}


def keep(run_dir: Path, out: Path) -> None:
    """The small parts of the run folder (not weights, checkpoints or rollouts)."""
    for name in ("metrics.jsonl", "report.html", "logs", "preflight", "configs"):
        source = run_dir / name
        if source.is_dir():
            shutil.copytree(source, out / name, dirs_exist_ok=True)
        elif source.exists():
            shutil.copy2(source, out / name)


def main() -> None:
    args = parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / f"rl-{args.backend}"
        exit_code, wall_s = run_rl(args, run_dir)
        summary = {"backend": args.backend, "exact": args.exact, "max_steps": args.max_steps, "exit_code": exit_code, "wall_s": wall_s,
                   "commit": source_commit(args.commit), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                   **summarize(run_dir)}
        keep(run_dir, out)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
