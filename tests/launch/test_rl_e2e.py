"""`tandem rl` end to end on CPU: warm-up, async RL, exact mode, two trainer ranks, broadcast weights, LoRA.

A killed trainer is in test_failures.py, with the other processes.

These run the real three processes (inference server, orchestrator, trainer) on the tiny model,
with `examples/reverse_text`'s configs and fewer RL steps, so that CI stays within minutes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from short_runs import run_pids, start

from tandem.monitor.metrics import read_metrics
from tandem.transport.paths import final_weights_dir, is_stable, rollout_file, weights_dir

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "reverse_text"

pytestmark = pytest.mark.slow


def tandem(*args: str, timeout: float = 480) -> subprocess.CompletedProcess:
    """`tandem *args`, run to its end. Past `timeout` (under pytest's 600 s), the run's processes print their
    stacks into their logs (SIGUSR1) before the launcher is killed, and the failure shows those logs' tails:
    a resumed run once sat for minutes before its trainer's first log line, and nothing said where."""
    proc = start([sys.executable, "-m", "tandem.cli", *args])
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out = Path(args[args.index("--output-dir") + 1])
        for pid in run_pids(out).values() if (out / "logs" / "pids.json").is_file() else []:
            with contextlib.suppress(ProcessLookupError):  # one that has ended already
                os.kill(pid, signal.SIGUSR1)
        time.sleep(2)
        proc.kill()
        proc.communicate()
        tails = {log.name: log.read_text()[-4000:] for log in sorted((out / "logs").glob("*.log"))}
        pytest.fail(f"tandem {' '.join(args)}: still running after {timeout} s; its logs end with {tails}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def sft_config(tmp_path_factory) -> Path:
    """The example's SFT config, its paths in a tmp folder, cut to 200 of its 1,500 steps (CI's time): RL starts
    from a model that has begun to reverse and has the demonstrator's tag slip to unlearn (the learning test's
    training reward, mean of the first and last 4 of its 12 steps: 0.20 -> 0.25 after 300 warm-up steps, twice,
    and 0.19 -> 0.23 after 200, on the 2-core CPU)."""
    root = tmp_path_factory.mktemp("reverse")
    text = (EXAMPLE / "sft.toml").read_text()
    assert "max_steps = 1500" in text
    text = text.replace("outputs/reverse-text", str(root)).replace("max_steps = 1500", "max_steps = 200")
    path = root / "sft.toml"
    path.write_text(text)
    return path


def rl_args(sft_config: Path, out: Path, max_steps: int, *extra: str) -> list[str]:
    root = sft_config.parent
    return [
        "rl", "@", str(EXAMPLE / "rl.toml"),
        "--model.name", str(root / "sft" / "weights" / "final"),
        "--warmup.sft", str(sft_config),
        "--output-dir", str(out),
        "--max-steps", str(max_steps),
        "--ckpt.interval", "3",
        "--orchestrator.eval.interval", "100",
        "--orchestrator.eval.num-examples", "32",
        "--preflight.enabled", "false",  # tests/launch/test_preflight.py runs it
        *extra,
    ]


def steps_of(run_dir: Path, process: str, key: str) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir, process) if key in r]


LORA = ("--trainer.lora.enabled", "true", "--trainer.optim.lr", "2e-3", "--weight-transport.type", "broadcast",
        "--ckpt.enabled", "false", "--orchestrator.eval.interval", "0")
"""The LoRA run's options: its test reads the training reward, so it runs no evals."""


@pytest.fixture(scope="module")
def learning_runs(sft_config, tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """The example's run, 12 steps from the cut warm-up that `tandem rl` runs first, and the LoRA run, 12 steps
    from the same model, by name. The LoRA run starts once the warm-up has published its model, and the two learn
    side by side (CI's time: a run's server and trainer wait on each other at times, leaving a core to the other
    run; one torch thread per process, `short_runs.env`, keeps their threads from outnumbering the cores)."""
    root = tmp_path_factory.mktemp("learning")
    model = final_weights_dir(sft_config.parent / "sft")
    with ThreadPoolExecutor() as pool:
        full = pool.submit(tandem, *rl_args(sft_config, root / "full", 12))
        while not is_stable(model) and not full.done():  # a failed warm-up: the LoRA run then fails on its folder
            time.sleep(1)
        lora = pool.submit(tandem, *rl_args(sft_config, root / "lora", 12, *LORA))
        return {"full": (full.result(), root / "full"), "lora": (lora.result(), root / "lora")}


def test_rl_learns_from_the_warm_up(learning_runs):
    """The example's run, 12 steps from the cut warm-up: reward rises. Resuming is tested on its own
    (tests/launch/test_resume_records.py: a stopped and resumed run against one that never stopped)."""
    result, out = learning_runs["full"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert "running the SFT warm-up" in result.stderr
    assert (out / "report.html").is_file()
    trainer = list(read_metrics(out, "trainer"))
    assert [r["step"] for r in trainer] == list(range(1, 13))
    kls = [r["mismatch_kl"] for r in trainer if r["mismatch_kl"] is not None]
    assert sum(kls) / len(kls) < 1e-3, kls
    # steps trained on rollouts of the previous policy: mismatch plus one step of drift, well above the mismatch
    # (one run with a 600-step warm-up on the 2-core CPU: 0.0025-0.0106, the first off-policy step the largest)
    off_kls = [r["off_policy_kl"] for r in trainer if r["off_policy_kl"] is not None]
    assert off_kls and max(off_kls) < 5e-2 and min(off_kls) > 10 * max(kls), (off_kls, kls)
    rewards = [r["reward/mean"] for r in read_metrics(out, "orchestrator") if "reward/mean" in r]
    print("rewards", rewards)
    assert len(rewards) == 12 and sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4, rewards


def test_an_exact_run_logs_mismatch_kl_zero_at_every_step(sft_config, tmp_path):
    """`run.exact = true` through the three real processes, synchronous so that every step trains only on tokens
    its own policy sampled: their mismatch KL is exactly 0 at every step, in metrics.jsonl and in the report. So the
    engine's logprobs crossed HTTP and the batch files with all their bits, and the server's reloaded policy 1 is
    the trainer's to the last bit (fp32 on the CPU; the engine's exact path, token by token)."""
    out = tmp_path / "exact"
    warmed = (sft_config.parent / "sft" / "weights" / "final").exists()  # by the learning test, when it ran first
    # Checkpointing recomputes, it does not change a logprob: off, the CPU's token-by-token exact trainer runs
    # about 4x faster (its per-tensor hooks dominate there; docs/trainer.md).
    small = ("--orchestrator.batch-size", "8", "--orchestrator.group-size", "4",
             "--trainer.parallel.activation-checkpoint.mode", "off")
    result = tandem(*rl_args(sft_config, out, 2, "--run.exact", "true", "--orchestrator.max-async-level", "0", *small,
                             "--orchestrator.advantage.filter-zero-groups", "false", "--orchestrator.eval.interval", "0",
                             "--ckpt.enabled", "false"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("running the SFT warm-up" in result.stderr) is not warmed  # a starting model that exists is used as is
    trainer = list(read_metrics(out, "trainer"))
    assert [(r["step"], r["mismatch_kl"], r["off_policy_kl"]) for r in trainer] == [(1, 0.0, None), (2, 0.0, None)]
    assert trainer[0]["loss"] != 0  # step 1 moved the weights: step 2 sampled and scored a new policy
    assert "<td>mismatch_kl_mean</td><td>0</td>" in (out / "report.html").read_text()


def test_two_trainer_ranks_run_under_torchrun(sft_config, tmp_path):
    """`deployment.num_trainer_processes = 2`: the launcher starts the trainer under torchrun (gloo),
    the orchestrator writes a batch file per rank, and the run ends like a one-rank run."""
    out = tmp_path / "two-ranks"
    # The wiring is the point, not learning: small batches of short rollouts, no evals.
    small = ("--orchestrator.batch-size", "8", "--orchestrator.group-size", "4", "--orchestrator.sampling.max-tokens", "16",
             "--orchestrator.eval.interval", "0")
    result = tandem(*rl_args(sft_config, out, 3, "--deployment.num-trainer-processes", "2", "--ckpt.enabled", "false", *small))
    assert result.returncode == 0, result.stderr[-3000:]
    assert steps_of(out, "trainer", "loss") == [1, 2, 3]
    for step in (1, 2, 3):
        assert rollout_file(out, step, 0).is_file() and rollout_file(out, step, 1).is_file(), step
    assert "2 rank(s) on cpu" in (out / "logs" / "trainer.log").read_text()
    assert is_stable(weights_dir(out, 3))


def test_broadcast_weights_to_two_servers_give_the_rewards_of_folders(sft_config, tmp_path):
    """The same seeded synchronous run twice: weights through folders to one server, then broadcast
    (gloo) to two servers. Policy n samples batch n+1 in both, so equal rewards at every step mean
    the servers sampled with the same weights."""
    same = ("--orchestrator.max-async-level", "0", "--orchestrator.sampling.seeded", "true",
            "--orchestrator.advantage.filter-zero-groups", "false", "--orchestrator.batch-size", "32",
            "--orchestrator.eval.interval", "0", "--ckpt.enabled", "false")
    folders, broadcast = tmp_path / "folders", tmp_path / "broadcast"
    runs = (rl_args(sft_config, folders, 3, *same),
            rl_args(sft_config, broadcast, 3, *same, "--weight-transport.type", "broadcast",
                    "--deployment.num-inference-servers", "2"))
    with ThreadPoolExecutor() as pool:  # side by side: a synchronous run leaves a CI core idle while it waits
        for result in pool.map(lambda args: tandem(*args), runs):
            assert result.returncode == 0, result.stderr[-3000:]

    def rewards(run_dir: Path) -> list[float]:
        return [r["reward/mean"] for r in read_metrics(run_dir, "orchestrator") if "reward/mean" in r]

    # Equal up to the order of summing a step's rollouts (one different token moves a mean by about 1e-3).
    assert len(rewards(folders)) == 3 and rewards(broadcast) == pytest.approx(rewards(folders), abs=1e-12)
    assert "loaded policy 3 into 2 server(s)" in (broadcast / "logs" / "orchestrator.log").read_text()
    assert not weights_dir(broadcast, 2).exists() and is_stable(weights_dir(broadcast, 3))  # only the result is written


def test_lora_rl_learns_with_its_adapters_broadcast(learning_runs):
    """`trainer.lora`: only the adapters train and travel (broadcast over gloo, kilobytes), the server merges each
    update into its kept base; trainer and server agree as with full weights (mismatch KL), and reward rises."""
    result, out = learning_runs["lora"]
    assert result.returncode == 0, result.stderr[-3000:]
    trainer = list(read_metrics(out, "trainer"))
    kls = [r["mismatch_kl"] for r in trainer if r["mismatch_kl"] is not None]
    assert len(trainer) == 12 and sum(kls) / len(kls) < 1e-3, kls
    rewards = [r["reward/mean"] for r in read_metrics(out, "orchestrator") if "reward/mean" in r]
    print("rewards", rewards)
    assert len(rewards) == 12 and sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4, rewards
    assert {p.name for p in weights_dir(out, 12).iterdir()} == {"adapter_config.json", "adapter_model.safetensors", "STABLE"}
