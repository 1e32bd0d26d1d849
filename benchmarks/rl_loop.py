"""The whole asynchronous RL loop on one machine: `tandem rl` as a user runs it, at several `max_async_level`s.

    python benchmarks/rl_loop.py --preset tiny --device cpu --out rl-loop-cpu.json          # minutes on a CPU
    python benchmarks/rl_loop.py --preset qwen3-0.6b --device cuda --out $OUT/rl-loop.json  # one GPU, a few minutes

Each level is one `tandem rl` run (launcher, inference server, orchestrator, trainer: the real processes meeting in
the run folder), with inference and trainer sharing the device (on CUDA: GPU 0, the engine taking
`deployment.shared_gpu_memory_fraction`). The model is a preset's shape with random weights made on the device
(`model.load_format = "dummy"`); the environment is `fixed_length`: every rollout samples exactly
`--completion-tokens` tokens (EOS ignored) after a prompt of `--prompt-chars` letters, so every step does the same
work. Evals, checkpoints and the preflight are off; weights go through folders (the only transport on a shared GPU).

Every figure comes from the run's `metrics.jsonl`, as the processes log it. Over the steps after `--warmup`:
- step time: the interval between two trainer steps (the loop's period), and tokens/s of the loop at that period
  (tokens trained; tokens sampled);
- the trainer's side: waiting for its batch, computing the step, publishing the weights;
- the orchestrator's side: rollouts in flight (generation), gated on a newer policy (waiting on the trainer), the
  servers' weight reloads (within one of those two) and packing, and the mean and longest time a rollout waited on
  the server (against generation: what the orchestrator's own work adds). Orchestrator step n's window holds its
  wait for policy n-1-level, so its steps count from `1 + level` steps after the trainer's, clear of the trainer's
  warm-up.
At level 0 generation and training never overlap, so that run also measures each alone: generation alone is its
generation time, training alone its trainer compute + publish time. The summary gives the async speedup (level 0's
step time over level 1's) and the goal's ratio: level 1's step time over the slower of generation and training
alone (issue 23's goal: at most 1.15).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from statistics import fmean as mean, median

import tomli_w
import torch

from provenance import environment, source_commit
from tandem.models.presets import PRESETS, init_model
from tandem.monitor.metrics import read_metrics

GOAL_RATIO = 1.15
"""Issue 23: at level 1, the step time within 15% of the slower of generation and training alone."""

STOP_GRACE_S = 60.0
"""How long a run past `--timeout-s` gets to stop its processes after SIGTERM."""

WORKLOADS = {
    "cuda": dict(batch_size=256, group_size=8, completion_tokens=512, prompt_chars=64, seq_len=8192, steps=10, warmup=2),
    "cpu": dict(batch_size=8, group_size=4, completion_tokens=16, prompt_chars=16, seq_len=256, steps=4, warmup=1),
}
"""Default workload per device type: 256 rollouts x 512 tokens a step on a GPU, a few short ones on a CPU."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=list(PRESETS), default="tiny")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--num-layers", type=int, help="cut the preset to this many blocks (a quick check of a real shape)")
    parser.add_argument("--levels", default="0,1", help="comma-separated max_async_level values, one run each")
    for name in WORKLOADS["cuda"]:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, help=f"default: {WORKLOADS['cuda'][name]} on cuda, "
                                                                          f"{WORKLOADS['cpu'][name]} on cpu")
    parser.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank (0: every weight)")
    parser.add_argument("--share-base", action="store_true",
                        help="with --lora-rank: one copy of the frozen base, the trainer's, mapped by the engine "
                             "(`lora.share_base`); --engine-memory-gib then counts the trainer's memory at the engine's "
                             "start (the base among it), which the engine finds in use")
    parser.add_argument("--engine-memory-gib", type=float,
                        help="cuda: the engine's share of the GPU (weights, KV cache, activations) in GiB; default "
                             "`deployment.shared_gpu_memory_fraction`'s")
    parser.add_argument("--activation-checkpoint", choices=["off", "selective", "full"], help="the trainer's mode")
    parser.add_argument("--logprob-chunk-size", type=int, help="the trainer's `logprob_chunk_size`")
    parser.add_argument("--timeout-s", type=float, default=600, help="limit of each level's run")
    parser.add_argument("--keep", help="keep the model and the run folders in this folder (default: a temporary one)")
    parser.add_argument("--out", help="write the figures to this JSON file (rewritten after each level)")
    parser.add_argument("--commit", help="the commit measured (default: git's HEAD)")
    args = parser.parse_args()
    for name, default in WORKLOADS[args.device].items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    args.levels = [int(level) for level in args.levels.split(",")]
    if args.warmup < 1:
        parser.error("need --warmup >= 1: a step's time is measured from the end of the previous one")
    if args.share_base and not args.lora_rank:
        parser.error("--share-base shares a LoRA run's frozen base: give --lora-rank")
    if args.steps <= args.warmup + 1 + max(args.levels):
        parser.error(f"--steps {args.steps}: at level {max(args.levels)} the orchestrator's first step clear of "
                     f"the warm-up is {args.warmup + 2 + max(args.levels)}")
    return args


def rl_config(args: argparse.Namespace, level: int, model: Path, run_dir: Path) -> dict:
    """The `tandem rl` config of one level."""
    deployment = {"type": "cpu"}
    if args.device == "cuda":
        deployment = {"type": "gpu", "inference_devices": [0], "trainer_devices": [0]}
    if args.engine_memory_gib is not None:
        deployment["shared_gpu_memory_fraction"] = args.engine_memory_gib * 2**30 / gpu_total_bytes()
    trainer: dict = {}
    if args.lora_rank:
        trainer["lora"] = {"enabled": True, "rank": args.lora_rank, "alpha": 2.0 * args.lora_rank,
                           "share_base": args.share_base}
    if args.activation_checkpoint:
        trainer["parallel"] = {"activation_checkpoint": {"mode": args.activation_checkpoint}}
    if args.logprob_chunk_size:
        trainer["logprob_chunk_size"] = args.logprob_chunk_size
    return {
        "model": {"name": str(model), "load_format": "dummy"},
        "trainer": trainer,
        "output_dir": str(run_dir),
        "seq_len": args.seq_len,
        "max_steps": args.steps,
        "seed": 0,
        "deployment": deployment,
        "ckpt": {"enabled": False},
        "preflight": {"enabled": False},
        # No sequence longer than a training row is of use: the cache need not hold one of the model's whole context.
        "inference": {"server": {"port": 0}, "engine": {"max_num_seqs": args.batch_size, "max_model_len": args.seq_len}},
        "orchestrator": {
            "batch_size": args.batch_size,
            "group_size": args.group_size,
            "max_async_level": level,
            "max_concurrent_rollouts": args.batch_size,
            "sampling": {"temperature": 1.0, "max_tokens": args.completion_tokens},
            "envs": [{"id": "fixed_length", "args": {"prompt_chars": args.prompt_chars}}],
            "eval": {"interval": 0},
            "advantage": {"filter_zero_groups": False},  # every step samples exactly batch_size rollouts
        },
    }


def run_level(args: argparse.Namespace, level: int, model: Path, root: Path) -> dict:
    """One `tandem rl` run at `level`; its figures, or the error that stopped it."""
    run_dir = root / f"level-{level}"
    config_path = root / f"level-{level}.toml"
    config_path.write_text(tomli_w.dumps(rl_config(args, level, model, run_dir)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    start = time.monotonic()
    launcher = subprocess.Popen([sys.executable, "-m", "tandem.cli", "rl", "@", str(config_path)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    memory = GpuMemory() if args.device == "cuda" else None
    try:
        _, stderr = launcher.communicate(timeout=args.timeout_s)
    except subprocess.TimeoutExpired:
        stderr = stop(launcher)
        return {"error": f"the run took more than --timeout-s = {args.timeout_s:.0f}s: {stderr[-3000:]}"}
    finally:
        if memory is not None:
            memory.stop()
    if launcher.returncode != 0:
        return {"error": f"`tandem rl` exited {launcher.returncode}: {stderr[-3000:]}"}
    wall_s = time.monotonic() - start
    gpu = {} if memory is None else {"gpu_memory": memory.figures(run_dir)}
    try:
        return {"wall_s": wall_s, **gpu, **kv_cache(run_dir), **level_figures(run_dir, args.warmup, level)}
    except (KeyError, RuntimeError) as err:  # a run that logged less than expected: keep the other levels
        return {"error": f"{type(err).__name__}: {err}"}


def kv_cache(run_dir: Path) -> dict:
    """The KV cache the server planned, as its log states it (`tandem.inference.engine.setup`); {} if it does not."""
    log = run_dir / "logs" / "inference.log"
    found = re.search(r"KV cache: (\d+) blocks of (\d+) tokens \(([\d.]+) GiB", log.read_text()) if log.is_file() else None
    if found is None:
        return {}
    blocks, block_size, gib = int(found[1]), int(found[2]), float(found[3])
    return {"kv_cache": {"blocks": blocks, "tokens": blocks * block_size, "gib": gib}}


def gpu_total_bytes() -> int:
    """GPU 0's memory, from `nvidia-smi`: this process makes no CUDA context, whose memory would count in the run's."""
    out = subprocess.run(["nvidia-smi", "--id=0", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return int(out.strip()) * 2**20


class GpuMemory:
    """What `nvidia-smi` shows each process of the run holding on the GPU (its CUDA context, caching allocator and
    all), sampled every half second: the peak of their sum is what the run needs of the GPU."""

    def __init__(self, interval_s: float = 0.5):
        self.samples: list[dict[int, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, args=(interval_s,), daemon=True)
        self._thread.start()

    def _poll(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True).stdout
            self.samples.append({int(pid): float(mib) / 1024 for pid, mib in
                                 (line.split(",") for line in out.strip().splitlines() if line.strip())})

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def figures(self, run_dir: Path) -> dict:
        """Peak GiB of the processes together and of each (named from the run's `logs/pids.json`)."""
        pids = json.loads((run_dir / "logs" / "pids.json").read_text()) if (run_dir / "logs" / "pids.json").is_file() else {}
        names = {int(pid): name for name, pid in pids.items()}
        each: dict[str, float] = {}
        for sample in self.samples:
            for pid, gib in sample.items():
                name = names.get(pid, str(pid))
                each[name] = max(each.get(name, 0.0), gib)
        return {"peak_total_gib": max((sum(s.values()) for s in self.samples), default=0.0), "peak_each_gib": each,
                "trainer_peak_allocated_gib": max((r.get("peak_memory_gib", 0.0) for r in read_metrics(run_dir, "trainer")
                                                   if "loss" in r), default=0.0)}


def stop(launcher: subprocess.Popen) -> str:
    """SIGTERM, on which `tandem rl` stops the processes it started (a kill would leave them holding the device);
    a kill only if it has not exited after `STOP_GRACE_S`. Returns its stderr."""
    launcher.send_signal(signal.SIGTERM)
    try:
        return launcher.communicate(timeout=STOP_GRACE_S)[1]
    except subprocess.TimeoutExpired:
        launcher.kill()
        return launcher.communicate()[1]


def level_figures(run_dir: Path, warmup: int, level: int) -> dict:
    """Means of what trainer and orchestrator logged over their steps clear of the warm-up."""
    trainer = {r["step"]: r for r in read_metrics(run_dir, "trainer") if "loss" in r}
    orchestrator = {r["step"]: r for r in read_metrics(run_dir, "orchestrator") if "reward/mean" in r}
    timed = [s for s in sorted(trainer) if s > warmup and s - 1 in trainer]
    # Orchestrator step k's window holds its wait for policy k-1-level: the trainer step that made it must be warm.
    orchestrator_timed = [s for s in sorted(orchestrator) if s > warmup + 1 + level]
    if not timed or not orchestrator_timed:
        raise RuntimeError(f"{run_dir}: no step past the warm-up (trainer steps {sorted(trainer)}, orchestrator steps "
                           f"{sorted(orchestrator)}); raise --steps")

    step_s = [trainer[s]["time"] - trainer[s - 1]["time"] for s in timed]
    period = mean(step_s)
    return {
        "timed_steps": timed,
        "step_s": period,
        "step_s_each": step_s,
        "step_s_median": median(step_s),  # beside the mean: one slow step among few moved the mean by 10% (2026-12-04)
        "trained_tokens_per_s": mean(trainer[s]["num_tokens"] for s in timed) / period,
        "sampled_tokens_per_s": mean(trainer[s]["num_loss_tokens"] for s in timed) / period,
        "trainer": {
            "wait_batch_s": mean(trainer[s]["time_wait_batch"] for s in timed),
            "compute_s": mean(trainer[s]["time_step"] for s in timed),
            "publish_s": mean(trainer[s]["time_publish"] for s in timed),
        },
        "orchestrator": {
            "window_s": mean(orchestrator[s]["time/step_s"] for s in orchestrator_timed),
            "generation_s": mean(orchestrator[s]["time/wait_inference_s"] for s in orchestrator_timed),
            "wait_trainer_s": mean(orchestrator[s]["time/wait_trainer_s"] for s in orchestrator_timed),
            "update_weights_s": mean(orchestrator[s]["time/update_weights_s"] for s in orchestrator_timed),
            "pack_s": mean(orchestrator[s]["time/pack_s"] for s in orchestrator_timed),
            "rollout_inference_mean_s": mean(orchestrator[s]["time/rollout_inference_mean_s"] for s in orchestrator_timed),
            "rollout_inference_max_s": mean(orchestrator[s]["time/rollout_inference_max_s"] for s in orchestrator_timed),
        },
        "orchestrator_timed_steps": orchestrator_timed,
        "off_policy_max": max(r["off_policy/max"] for r in orchestrator.values()),
        "reward_mean": mean(r["reward/mean"] for r in orchestrator.values()),
        "loss_mean": mean(trainer[s]["loss"] for s in timed),
        "mismatch_kl_mean": mean(kls) if (kls := [r["mismatch_kl"] for r in trainer.values()
                                                   if r.get("mismatch_kl") is not None]) else None,
    }


def summary(levels: dict[str, dict]) -> dict:
    """Generation and training alone (from level 0), the async speedup and the goal's ratio (level 1)."""
    sync, async_ = levels.get("0", {}), levels.get("1", {})
    if "step_s" not in sync:
        return {}
    out = {"generation_alone_s": sync["orchestrator"]["generation_s"],
           "training_alone_s": sync["trainer"]["compute_s"] + sync["trainer"]["publish_s"]}
    out["slower_alone_s"] = max(out["generation_alone_s"], out["training_alone_s"])
    if "step_s" in async_:
        out["async_speedup"] = sync["step_s"] / async_["step_s"]
        out["level1_over_slower_alone"] = async_["step_s"] / out["slower_alone_s"]
        out["goal_ratio"] = GOAL_RATIO
        out["goal_met"] = out["level1_over_slower_alone"] <= GOAL_RATIO
    return out


def print_table(levels: dict[str, dict], totals: dict) -> None:
    rows = [("step time (s)", lambda f: f["step_s"]),
            ("tokens trained /s", lambda f: f["trained_tokens_per_s"]),
            ("tokens sampled /s", lambda f: f["sampled_tokens_per_s"]),
            ("trainer: wait for batch (s)", lambda f: f["trainer"]["wait_batch_s"]),
            ("trainer: compute (s)", lambda f: f["trainer"]["compute_s"]),
            ("trainer: publish weights (s)", lambda f: f["trainer"]["publish_s"]),
            ("orch.: generation (s)", lambda f: f["orchestrator"]["generation_s"]),
            ("orch.: wait for policy (s)", lambda f: f["orchestrator"]["wait_trainer_s"]),
            ("orch.: reload weights (s)", lambda f: f["orchestrator"]["update_weights_s"]),
            ("orch.: pack (s)", lambda f: f["orchestrator"]["pack_s"]),
            ("rollout on the server, mean (s)", lambda f: f["orchestrator"]["rollout_inference_mean_s"]),
            ("rollout on the server, max (s)", lambda f: f["orchestrator"]["rollout_inference_max_s"]),
            ("off-policy max (steps)", lambda f: f["off_policy_max"])]
    names = list(levels)
    print(f"{'max_async_level':<30}" + "".join(f"{n:>14}" for n in names))
    for label, get in rows:
        cells = [f"{get(levels[n]):>14.3f}" if "step_s" in levels[n] else f"{'failed':>14}" for n in names]
        print(f"{label:<30}" + "".join(cells))
    for key, value in totals.items():
        print(f"{key:<30}{value:>14.3f}" if isinstance(value, float) else f"{key:<30}{value!s:>14}")


def main() -> int:
    args = parse_args()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rl-loop-") as tmp:
        root = Path(args.keep or tmp)
        root.mkdir(parents=True, exist_ok=True)
        model = init_model(args.preset, root / "model", num_layers=args.num_layers, weights=False)
        settings = {k: v for k, v in vars(args).items() if k not in ("out", "commit", "keep")}
        result = {"benchmark": "rl_loop", "commit": source_commit(args.commit), "settings": settings, "levels": {},
                  "summary": {}}
        for level in args.levels:
            print(f"max_async_level {level}: `tandem rl` of {args.steps} steps ...", file=sys.stderr, flush=True)
            figures = run_level(args, level, model, root)
            result["levels"][str(level)] = figures
            print(f"max_async_level {level}: " + (f"done in {figures['wall_s']:.0f}s" if "wall_s" in figures else "failed"),
                  file=sys.stderr, flush=True)
            result["summary"] = summary(result["levels"])
            if args.out:
                Path(args.out).write_text(json.dumps(result, indent=2))
    result["environment"] = environment(torch.device(args.device), args.commit)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    print_table(result["levels"], result["summary"])
    failed = {level: f["error"] for level, f in result["levels"].items() if "error" in f}
    for level, error in failed.items():
        print(f"level {level} failed: {error}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
