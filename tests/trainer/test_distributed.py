"""World size 2 (torchrun, gloo, FSDP) trains exactly like world size 1 (plain tensors), each resumes the
other's checkpoint, and the trainer benchmark measures the same global batch at both."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tandem.transport.paths import weights_dir

from trainer_helpers import losses, run_trainer

pytestmark = pytest.mark.slow


def torchrun_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def torchrun_trainer(*args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    """`tandem trainer ARGS` under torchrun. Tests run a one-rank run in their own process beside a launch of 2
    ranks (one thread each, `trainer_helpers.one_thread`): the 2 ranks alone leave part of CI's 2 cores idle. Not
    beside 4 ranks, which keep both busy (benchmarks/RESULTS.md)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "tandem.cli", "trainer", *args]
    return subprocess.run(cmd, env=torchrun_env(), capture_output=True, text=True, timeout=180)


def torchrun_commands(*commands: list[str] | dict, nproc: int) -> subprocess.CompletedProcess:
    """`tandem` commands (and `{"copy": [SRC, DST]}` and `{"script": PATH, "argv": [...]}` steps) one after another
    in one launch of `nproc` ranks (torchrun_commands.py)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(Path(__file__).resolve().parent / "torchrun_commands.py"), json.dumps(commands, default=str)]
    return subprocess.run(cmd, env=torchrun_env(), capture_output=True, text=True, timeout=300)


BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "trainer.py"
BENCHMARK_ARGS = ["--preset", "tiny", "--device", "cpu", "--shapes", "64:2:4", "--steps", "2", "--warmup", "1"]


@pytest.fixture(scope="module")
def two_rank_runs(tiny_model, tmp_path_factory) -> dict[str, Path]:
    """Run folders (and the trainer benchmark's reports) by name. One launch of 2 ranks: they train, then resume
    the 1-rank checkpoint of step 2 (DCP reshards model and optimizer state), then run the trainer benchmark. The
    one-rank trainer runs before the launch, which resumes its checkpoint; the benchmark's one-rank run beside it."""
    root = tmp_path_factory.mktemp("two-ranks")
    runs = {name: root / name for name in ("one", "two", "resumed", "benchmark-one.json", "benchmark-two.json")}
    assert run_trainer(*trainer_args(tiny_model), "--output-dir", str(runs["one"])) == 0
    shutil.copytree(runs["one"] / "checkpoints" / "step_2", runs["resumed"] / "checkpoints" / "step_2")
    with ThreadPoolExecutor() as pool:  # side by side: the one-process benchmark alone leaves a CI core idle
        launched = pool.submit(torchrun_commands, ["trainer", *trainer_args(tiny_model), "--output-dir", runs["two"]],
                               ["trainer", *trainer_args(tiny_model), "--output-dir", runs["resumed"], "--ckpt.resume"],
                               {"script": BENCHMARK, "argv": [*BENCHMARK_ARGS, "--out", runs["benchmark-two.json"]]},
                               nproc=2)
        one = subprocess.run([sys.executable, str(BENCHMARK), *BENCHMARK_ARGS, "--out", str(runs["benchmark-one.json"])],
                             env=torchrun_env(), capture_output=True, text=True, timeout=180)
        result = launched.result()
    assert one.returncode == 0, one.stderr[-3000:]
    assert result.returncode == 0, result.stderr[-3000:]
    return runs


def trainer_args(model: Path) -> list[str]:
    return ["--model.name", str(model), "--data.fake", "--data.fake-rows", "4", "--data.fake-samples-per-row", "2",
            "--max-steps", "4", "--seq-len", "64", "--optim.lr", "3e-3", "--device", "cpu",
            "--ckpt.enabled", "--ckpt.interval", "2", "--ckpt.keep", "2"]


def test_two_ranks_follow_the_one_rank_trajectory(tiny_model, two_rank_runs, tmp_path):
    one, two, resumed, back = two_rank_runs["one"], two_rank_runs["two"], two_rank_runs["resumed"], tmp_path / "back"
    ref = losses(one)
    assert sorted(losses(two)) == [1, 2, 3, 4]
    for step, loss in losses(two).items():
        assert loss == pytest.approx(ref[step], abs=1e-5), step
    assert len(set(ref.values())) == 4  # the trajectory moves
    w1, w2 = load_file(weights_dir(one, 4) / "model.safetensors"), load_file(weights_dir(two, 4) / "model.safetensors")
    # Adam normalizes each element's update, so an element whose gradient is ~0 can move by a
    # fraction of lr (3e-3) on fp32 rounding differences alone: compare weights at that scale.
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) < 1e-4

    # And back, after the launch: the ranks' (FSDP) checkpoint of step 2, resumed by the one-rank path's plain tensors.
    shutil.copytree(two / "checkpoints" / "step_2", back / "checkpoints" / "step_2")
    assert run_trainer(*trainer_args(tiny_model), "--output-dir", str(back), "--ckpt.resume") == 0
    assert sorted(losses(resumed)) == [3, 4]
    for step, loss in losses(resumed).items():
        assert loss == pytest.approx(ref[step], abs=1e-5), step

    assert sorted(losses(back)) == [3, 4]
    for step, loss in losses(back).items():
        assert loss == pytest.approx(ref[step], abs=1e-5), step


def test_trainer_benchmark_under_torchrun_trains_the_same_global_batch(two_rank_runs):
    one, two = two_rank_runs["benchmark-one.json"], two_rank_runs["benchmark-two.json"]
    (single,), (double,) = json.loads(one.read_text())["runs"], json.loads(two.read_text())["runs"]
    assert single["world_size"] == 1 and double["world_size"] == 2
    assert [x["loss"] for x in double["losses"]] == pytest.approx([x["loss"] for x in single["losses"]], abs=1e-5)
    assert len({x["loss"] for x in single["losses"]}) == 3  # three steps of different rows
    peak = json.loads(two.read_text())["peak_tflops"] * 1e12
    assert double["tokens_per_s_per_rank"] == pytest.approx(double["tokens_per_s"] / 2)
    assert double["mfu"] == pytest.approx(double["model_tflops_per_s"] * 1e12 / (2 * peak))


def test_trainer_benchmark_refuses_a_baseline_under_torchrun(tmp_path):
    result = subprocess.run([sys.executable, str(BENCHMARK), "--shapes", "64:2:4", "--baseline", "64:1:4"],
                            env={**os.environ, "WORLD_SIZE": "2", "RANK": "0"}, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "under torchrun (world size 2) give one --shapes entry, one --fp8 setting and no --baseline" in result.stderr


def test_trainer_benchmark_runs_a_moe_preset_beside_transformers(tmp_path):
    out = tmp_path / "moe.json"
    cmd = [sys.executable, str(BENCHMARK), "--preset", "tiny-moe", "--num-layers", "1", "--device", "cpu", "--shapes", "32:1:1",
           "--baseline", "32:1:1", "--steps", "1", "--warmup", "1", "--out", str(out)]
    result = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "MFU = (6 * P_active * tokens" in result.stderr
    report = json.loads(out.read_text())
    tandem, baseline = report["runs"]
    assert tandem["impl"] == "tandem" and baseline["impl"] == "baseline"
    assert baseline["options"]["model_class"] == "Qwen3MoeForCausalLM"
    assert tandem["active_params"] == baseline["active_params"]  # one count for both
    assert tandem["tokens_per_s"] > 0 and baseline["tokens_per_s"] > 0 and tandem["peak_memory_gib"] > 0
    # The same dummy weights, made on the device by name, and the same rows: the same first step.
    assert baseline["losses"][0]["loss"] == pytest.approx(tandem["losses"][0]["loss"], abs=1e-5)
    assert baseline["losses"][0]["grad_norm"] == pytest.approx(tandem["losses"][0]["grad_norm"], rel=1e-4)
