"""World size 2 (torchrun, gloo) trains exactly like world size 1, and resumes a 1-rank checkpoint."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from tandem.transport.paths import weights_dir

from trainer_helpers import losses, run_trainer

pytestmark = pytest.mark.slow


def torchrun_trainer(*args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "tandem.cli", "trainer", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)


def test_two_ranks_follow_the_one_rank_trajectory(tiny_model, tmp_path):
    common = ["--model.name", str(tiny_model), "--data.fake", "--data.fake-rows", "4", "--data.fake-samples-per-row", "2",
              "--max-steps", "4", "--seq-len", "64", "--optim.lr", "3e-3", "--device", "cpu",
              "--ckpt.enabled", "--ckpt.interval", "2", "--ckpt.keep", "2"]
    one, two, resumed = tmp_path / "one", tmp_path / "two", tmp_path / "resumed"
    assert run_trainer(*common, "--output-dir", str(one)) == 0

    result = torchrun_trainer(*common, "--output-dir", str(two))
    assert result.returncode == 0, result.stderr[-3000:]
    ref = losses(one)
    assert sorted(losses(two)) == [1, 2, 3, 4]
    for step, loss in losses(two).items():
        assert loss == pytest.approx(ref[step], abs=1e-5), step
    assert len(set(ref.values())) == 4  # the trajectory moves
    w1, w2 = load_file(weights_dir(one, 4) / "model.safetensors"), load_file(weights_dir(two, 4) / "model.safetensors")
    # Adam normalizes each element's update, so an element whose gradient is ~0 can move by a
    # fraction of lr (3e-3) on fp32 rounding differences alone: compare weights at that scale.
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) < 1e-4

    # The 1-rank checkpoint of step 2, resumed by 2 ranks: DCP reshards model and optimizer state.
    shutil.copytree(one / "checkpoints" / "step_2", resumed / "checkpoints" / "step_2")
    result = torchrun_trainer(*common, "--output-dir", str(resumed), "--ckpt.resume")
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(losses(resumed)) == [3, 4]
    for step, loss in losses(resumed).items():
        assert loss == pytest.approx(ref[step], abs=1e-5), step
