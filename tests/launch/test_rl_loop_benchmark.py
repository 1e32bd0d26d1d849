"""`benchmarks/rl_loop.py`: its arithmetic on written metrics, and one real `tandem rl` level on the CPU."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from short_runs import env

from tandem.monitor.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
BENCHMARK = REPO / "benchmarks" / "rl_loop.py"


@pytest.fixture
def rl_loop(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARK.parent))  # it imports `provenance` as a sibling script
    spec = importlib.util.spec_from_file_location("rl_loop", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_metrics(run_dir: Path, trainer_times: list[float], orchestrator_waits: list[float]) -> None:
    """Trainer steps logged at `trainer_times` (2 s computing each), orchestrator steps waiting as given."""
    lines = []
    for step, t in enumerate(trainer_times, start=1):
        lines.append({"process": "trainer", "step": step, "time": t, "loss": 0.1 * step, "num_tokens": 1000,
                      "num_loss_tokens": 800, "time_wait_batch": 0.5, "time_step": 2.0, "time_publish": 0.25})
    for step, wait in enumerate(orchestrator_waits, start=1):
        lines.append({"process": "orchestrator", "step": step, "time": 0.0, "reward/mean": 0.5, "off_policy/max": 1,
                      "time/step_s": 3.0, "time/wait_trainer_s": wait, "time/wait_inference_s": 3.0 - wait,
                      "time/update_weights_s": 0.1, "time/pack_s": 0.01,
                      "time/rollout_inference_mean_s": 1.5 + step, "time/rollout_inference_max_s": 2.5 + step})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_figures_leave_out_the_warm_up_on_both_sides(rl_loop, tmp_path):
    # Trainer step 1 (the warm-up) is slow; at level 1 orchestrator step 3 waited on policy 1, which it made.
    write_metrics(tmp_path, [10.0, 13.0, 16.0, 19.0, 22.0], [0.0, 0.0, 9.0, 1.0, 1.0])
    figures = rl_loop.level_figures(tmp_path, warmup=1, level=1)
    assert figures["timed_steps"] == [2, 3, 4, 5] and figures["step_s"] == pytest.approx(3.0)
    assert figures["orchestrator_timed_steps"] == [4, 5]
    assert figures["orchestrator"]["wait_trainer_s"] == pytest.approx(1.0)
    assert figures["orchestrator"]["generation_s"] == pytest.approx(2.0)
    assert figures["orchestrator"]["rollout_inference_mean_s"] == pytest.approx(6.0)  # steps 4 and 5: 5.5, 6.5
    assert figures["orchestrator"]["rollout_inference_max_s"] == pytest.approx(7.0)
    assert figures["trained_tokens_per_s"] == pytest.approx(1000 / 3) and figures["sampled_tokens_per_s"] == pytest.approx(800 / 3)
    assert figures["trainer"] == {"wait_batch_s": 0.5, "compute_s": 2.0, "publish_s": 0.25}
    with pytest.raises(RuntimeError, match="raise --steps"):
        rl_loop.level_figures(tmp_path, warmup=1, level=3)


def test_summary_compares_level_1_with_each_side_alone_at_level_0(rl_loop):
    def level(step_s, generation_s, compute_s, publish_s):
        return {"step_s": step_s, "orchestrator": {"generation_s": generation_s},
                "trainer": {"compute_s": compute_s, "publish_s": publish_s}}

    out = rl_loop.summary({"0": level(10.0, 4.0, 5.0, 1.0), "1": level(6.6, 3.0, 5.0, 1.0)})
    assert out["generation_alone_s"] == 4.0 and out["training_alone_s"] == 6.0 and out["slower_alone_s"] == 6.0
    assert out["async_speedup"] == pytest.approx(10 / 6.6)
    assert out["level1_over_slower_alone"] == pytest.approx(1.1) and out["goal_met"] is True
    assert rl_loop.summary({"0": level(10.0, 4.0, 5.0, 1.0), "1": level(7.2, 3.0, 5.0, 1.0)})["goal_met"] is False
    assert "async_speedup" not in rl_loop.summary({"0": level(10.0, 4.0, 5.0, 1.0), "1": {"error": "x"}})
    assert rl_loop.summary({"1": level(6.6, 3.0, 5.0, 1.0)}) == {}


@pytest.mark.slow
def test_benchmark_runs_the_async_loop_on_the_cpu(tmp_path):
    """Level 1 of the real loop (three processes, tiny model, fixed-length rollouts), figures from its metrics."""
    out = tmp_path / "rl-loop.json"
    cmd = [sys.executable, str(BENCHMARK), "--preset", "tiny", "--device", "cpu", "--levels", "1", "--steps", "4",
           "--warmup", "1", "--batch-size", "4", "--group-size", "2", "--completion-tokens", "8", "--seq-len", "128",
           "--keep", str(tmp_path / "runs"), "--out", str(out)]
    result = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step time (s)" in result.stdout
    report = json.loads(out.read_text())
    assert report["environment"]["device"] == "cpu" and report["environment"]["commit"]
    assert report["settings"]["levels"] == [1] and report["settings"]["batch_size"] == 4
    figures = report["levels"]["1"]
    assert figures["timed_steps"] == [2, 3, 4] and figures["orchestrator_timed_steps"] == [4]
    assert all(s > 0 for s in figures["step_s_each"])
    trainer, orchestrator = figures["trainer"], figures["orchestrator"]
    assert 0 < trainer["compute_s"] and sum(trainer.values()) <= figures["step_s"]
    assert orchestrator["generation_s"] > 0
    assert orchestrator["generation_s"] + orchestrator["wait_trainer_s"] == pytest.approx(orchestrator["window_s"])
    # The one timed orchestrator step loads a policy only if it was not ready (and loaded) in the window before:
    # timing decides, so the load time is checked over the whole run.
    assert 0 <= orchestrator["update_weights_s"] < orchestrator["window_s"]
    loads = [r["time/update_weights_s"] for r in read_metrics(tmp_path / "runs" / "level-1", "orchestrator")
             if "time/update_weights_s" in r]
    assert len(loads) == 4 and sum(loads) > 0 and all(t >= 0 for t in loads)
    # Every rollout has exactly its 8 tokens: the loss tokens of a step are batch x completion.
    assert figures["sampled_tokens_per_s"] * figures["step_s"] == pytest.approx(4 * 8)
    assert figures["trained_tokens_per_s"] > figures["sampled_tokens_per_s"]
    assert figures["off_policy_max"] == 1
    assert report["summary"] == {}  # no level 0 to compare with
