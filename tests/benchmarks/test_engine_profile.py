"""`benchmarks/engine_profile.py`: the GPU's idle time between its activities, and the host code each gap waited for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import engine_profile  # noqa: E402


def test_idle_time_is_what_no_activity_covers_and_goes_to_the_launcher_that_ended_each_gap():
    """Two steps (microseconds), out of order: overlapping kernels cover 0-10 and 12-30 (a copy at 14-20 inside);
    the gaps 10-12 and 40.5-41 end at `sample`'s kernels, 30-40 at `launch`'s; nothing counts before the first
    activity or after the last."""
    activities = [(12.0, 30.0, "sample"), (0.0, 6.0, "launch"), (4.0, 10.0, "forward"), (14.0, 20.0, "copy"),
                  (40.0, 40.5, "launch"), (41.0, 50.0, "sample")]
    idle = engine_profile.gpu_idle(activities, steps=2)
    assert idle["gpu_idle_ms_per_step"] == pytest.approx((2 + 10 + 0.5) / 1e3 / 2)
    assert idle["idle_before"] == [
        {"launcher": "launch", "ms_per_step": pytest.approx(10 / 1e3 / 2), "gaps_per_step": 0.5},
        {"launcher": "sample", "ms_per_step": pytest.approx(2.5 / 1e3 / 2), "gaps_per_step": 1.0}]
    assert engine_profile.gpu_idle([], steps=3) == {"gpu_idle_ms_per_step": 0.0, "idle_before": []}


def test_the_launcher_is_the_innermost_tandem_frame_around_the_op():
    module = SimpleNamespace(name="<string>(1): <module>", cpu_parent=None)
    step = SimpleNamespace(name="/repo/tandem/inference/engine/llm_engine.py(200): step", cpu_parent=module)
    sample = SimpleNamespace(name="/repo/tandem/inference/engine/sampler.py(40): sample", cpu_parent=step)
    torch_frame = SimpleNamespace(name="torch/nn/functional.py(10): softmax", cpu_parent=sample)
    op = SimpleNamespace(name="aten::softmax", cpu_parent=torch_frame)
    assert engine_profile.launcher(op) == "tandem/inference/engine/sampler.py(40): sample"
    assert engine_profile.launcher(SimpleNamespace(name="aten::mm", cpu_parent=module)) == "aten::mm"
    assert engine_profile.launcher(None) == engine_profile.NOT_LINKED


def test_profile_engine_runs_on_the_cpu(tmp_path):
    """`benchmarks/profile_engine.py` end to end at a tiny scale: its timed run and its profiled phases, written out
    (on the CPU no device activity: no idle time to tell)."""
    out = tmp_path / "profile.json"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "profile_engine.py"), "--preset", "tiny",
                             "--device", "cpu", "--scale", "0.05", "--out", str(out)],
                            cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert figures["timed"]["steps"] > 0
    assert set(figures["profiled"]) == {"prefill", "decode"}
    assert all(phase["wall_per_step_s"] > 0 and "gpu_idle_ms_per_step" not in phase
               for phase in figures["profiled"].values())
