"""Step phases (`tandem.trainer.phases`) and the profile `benchmarks/trainer.py --profile` writes from them."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent

from tandem.trainer import phases
from tandem.trainer.phases import phase, recording_phases

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_step_profile():
    spec = importlib.util.spec_from_file_location("step_profile", BENCHMARKS / "step_profile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_nested_phases_count_their_own_time_once(monkeypatch):
    clock = iter([0.0, 1.0, 3.0, 5.0, 5.0, 10.0])  # forward [0, 5] holding logprobs [1, 3]; optimizer [5, 10]
    monkeypatch.setattr(phases.time, "perf_counter", lambda: next(clock))
    with recording_phases(torch.device("cpu"), synchronize=True) as times:
        with phase("forward"):
            with phase("logprobs"):
                pass
        with phase("optimizer"):
            pass
    assert times.total == {"logprobs": 2.0, "forward": 5.0, "optimizer": 5.0}
    assert times.self == {"logprobs": 2.0, "forward": 3.0, "optimizer": 5.0}
    assert list(times.as_dict()) == ["optimizer", "forward", "logprobs"]  # longest self time first


def test_phases_outside_a_recording_do_nothing_and_recordings_do_not_nest():
    with phase("forward"):
        pass
    with recording_phases(torch.device("cpu"), synchronize=False) as times:
        with pytest.raises(RuntimeError, match="already being recorded"):
            with recording_phases(torch.device("cpu"), synchronize=False):
                pass
        with phase("forward"):
            pass
    assert times.self == {}  # not synchronised: ranges for the profiler only
    assert phases._recording is None


def event(name: str, start: float, end: float, device: DeviceType, annotation: bool = False) -> FunctionEvent:
    return FunctionEvent(0, name, 0, start, end, device_type=device, is_user_annotation=annotation)


def test_kernels_count_for_the_innermost_phase_and_annotations_are_not_kernels():
    step_profile = load_step_profile()
    events = [event("step/forward", 0, 100, DeviceType.CPU), event("step/logprobs", 60, 90, DeviceType.CPU),
              event("step/optimizer", 100, 200, DeviceType.CPU),
              event("gemm", 10, 30, DeviceType.CUDA), event("gemm", 20, 40, DeviceType.CUDA),  # overlapping: 30 us busy
              event("head", 65, 85, DeviceType.CUDA), event("adamw", 120, 130, DeviceType.CUDA),
              event("copy", 210, 215, DeviceType.CUDA),
              event("step/forward", 0, 100, DeviceType.CUDA, annotation=True)]  # the range on the GPU timeline
    assert step_profile.busy_by_phase(events) == pytest.approx(
        {"forward": 0.030, "logprobs": 0.020, "optimizer": 0.010, "outside phases": 0.005})
    assert step_profile.union_ms(step_profile.kernel_intervals(events)) == pytest.approx(0.065)


def test_device_idle_lists_the_longest_waits_with_the_host_ops_of_the_time():
    step_profile = load_step_profile()
    events = [event("step/forward", 0, 100, DeviceType.CPU), event("step/metrics_transfer", 100, 166, DeviceType.CPU),
              event("aten::item", 150, 166, DeviceType.CPU), event("cudaStreamSynchronize", 151, 165, DeviceType.CPU),
              event("step/optimizer", 166, 200, DeviceType.CPU),
              event("embedding", 5, 20, DeviceType.CUDA), event("gemm", 15, 150, DeviceType.CUDA),  # one busy stretch
              event("adamw", 170, 190, DeviceType.CUDA),
              event("step/forward", 0, 100, DeviceType.CUDA, annotation=True)]  # an annotation, not work
    idle = step_profile.idle_gaps(events, count=2)
    assert idle["idle_ms"] == pytest.approx(0.035) and idle["gaps"] == 3  # 0-5, 150-170, 190-200
    first, second = idle["longest"]
    assert first == {"start_ms": pytest.approx(0.150), "ms": pytest.approx(0.020), "phase": "metrics_transfer",
                     "host_ops": ["aten::item", "cudaStreamSynchronize"], "after_kernel": "gemm", "before_kernel": "adamw"}
    assert (second["start_ms"], second["phase"], second["after_kernel"]) == (pytest.approx(0.190), "optimizer", "adamw")
    assert step_profile.idle_gaps([event("gemm", 0, 10, DeviceType.CUDA)]) == {}  # no host events: no window


@pytest.mark.slow
def test_trainer_benchmark_profiles_a_shape_on_the_cpu(tmp_path):
    out, folder = tmp_path / "result.json", tmp_path / "profile"
    cmd = [sys.executable, str(BENCHMARKS / "trainer.py"), "--preset", "tiny", "--device", "cpu", "--shapes", "64:2:2", "32:1:1",
           "--steps", "1", "--warmup", "1", "--profile", str(folder), "--profile-shapes", "64:2:2", "--out", str(out)]
    result = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [(row["shape"], row["tokens_per_step"]) for row in report["table"]] == [("64:2:2", 128), ("32:1:1", 32)]
    assert all(row["ms_per_step"] > 0 and row["peak_memory_gib"] > 0 for row in report["table"])
    profiled, plain = report["runs"]
    assert "profile" not in plain and profiled["once_only_events_in_timed_steps"]["graphs_compiled"] == 0
    assert sorted(p.name for p in folder.iterdir()) == ["tandem-64x2x2.json", "tandem-64x2x2.trace.json.gz"]
    profile = json.loads((folder / "tandem-64x2x2.json").read_text())
    synced = profile["synchronised_phases"]
    expected = {"forward", "logprobs", "objective", "backward", "metrics", "grad_clip", "metrics_transfer", "optimizer",
                "zero_grad", "schedule"}
    assert set(synced["phases"]) == expected and set(profile["profiler"]["phases"]) == expected
    assert synced["phases"]["forward"]["calls"] == 2 and synced["phases"]["optimizer"]["calls"] == 1
    phase_ms = sum(p["self_ms"] for p in synced["phases"].values())
    assert phase_ms + synced["outside_phases_ms"] == pytest.approx(synced["step_ms"])
    assert profile["profiler"]["gpu_busy_fraction"] is None  # no GPU
    assert any(op["name"] == "aten::mm" for op in profile["profiler"]["top_ops_by_self_cpu_time"])
    assert profiled["profile"]["phases"] == synced["phases"]
    assert profile["publish_ms"] > 0 and profiled["profile"]["publish_ms"] == profile["publish_ms"]
