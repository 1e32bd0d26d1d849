"""W&B logging (`tandem.monitor.wandb_run`) in offline mode: the records of the W&B run it writes, read back."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from pydantic import ValidationError

pytest.importorskip("wandb")

from tandem.config.rl import RLConfig  # noqa: E402
from tandem.monitor.metrics import MetricsWriter  # noqa: E402
from tandem.monitor.wandb_run import WandbMirror  # noqa: E402
from tandem.transport.paths import rollouts_dir  # noqa: E402

import wandb_records  # noqa: E402  (this folder is on sys.path under pytest)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def config(run_dir: Path, resume: bool = False, **wandb) -> RLConfig:
    return RLConfig.model_validate({"output_dir": str(run_dir), "resume": resume, "run": {"name": "mirror-test"},
                                    "wandb": {"project": "tandem-test", "mode": "offline", "samples_interval": 2, **wandb}})


def write_samples(path: Path, rewards: list[float]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"env": "reverse_text", "status": "trained", "reward": r, "advantage": r - 0.5,
             "prompt": [{"role": "user", "content": f"reverse abc{i}"}], "completion": [{"role": "assistant", "content": "cba"}],
             "stop_reason": "stop", "error": None} for i, r in enumerate(rewards)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_every_process_figure_and_sample_table_reaches_one_wandb_run(tmp_path):
    orchestrator, trainer = MetricsWriter(tmp_path, "orchestrator"), MetricsWriter(tmp_path, "trainer")
    for step in (1, 2, 3):
        orchestrator.log(step, {"reward/mean": 0.1 * step, "off_policy/mean": 0.5, "note": "text is not a figure"})
    orchestrator.log(2, {"eval/reward_mean": 0.42})
    trainer.log(1, {"loss": 1.5, "mismatch_kl": 1e-4})
    write_samples(rollouts_dir(tmp_path, 2) / "samples.jsonl", [1.0, 0.0, 0.5])
    write_samples(tmp_path / "eval" / "step_2" / "samples.jsonl", [0.25])
    MetricsWriter(tmp_path, "sft").log(1, {"loss": 9.0})  # not an RL process: not mirrored

    mirror = WandbMirror(config(tmp_path, max_samples=2))
    mirror.update()
    trainer.log(2, {"loss": 1.25, "mismatch_kl": None})  # the trainer runs behind the orchestrator
    orchestrator.log(4, {"reward/mean": 0.4})  # a tabled step whose samples.jsonl comes after its figures
    mirror.update()
    write_samples(rollouts_dir(tmp_path, 4) / "samples.jsonl", [0.75])
    report = tmp_path / "report.html"
    report.write_text("<html></html>")
    mirror.finish({"steps": 4, "reward_last": 0.4, "eval_last": None}, report, failed=False)

    rows = wandb_records.history(tmp_path)
    trainer_rows = [(r["trainer/step"], r["trainer/loss"]) for r in rows if "trainer/loss" in r]
    assert trainer_rows == [(1, 1.5), (2, 1.25)]
    rewards = [(r["orchestrator/step"], r["orchestrator/reward/mean"]) for r in rows if "orchestrator/reward/mean" in r]
    assert rewards == [(1, 0.1), (2, 0.2), (3, pytest.approx(0.3)), (4, 0.4)]
    assert [r["orchestrator/eval/reward_mean"] for r in rows if "orchestrator/eval/reward_mean" in r] == [0.42]
    assert not any("orchestrator/note" in r or "sft/loss" in r for r in rows)
    tables = {(r["orchestrator/step"], key.split("/")[1], r[key.replace("_type", "nrows")])
              for r in rows for key in r if key.endswith("/_type") and r[key] == "table-file"}
    assert tables == {(2, "samples", 2), (2, "eval_samples", 1), (4, "samples", 1)}
    table_file = next((tmp_path / "wandb").glob("offline-run-*/files/media/table/orchestrator/samples_*.table.json"))
    table = json.loads(table_file.read_text())
    assert table["columns"][:5] == ["step", "env", "status", "reward", "advantage"]
    assert table["data"][0][5] == "user: reverse abc0" and table["data"][0][6] == "assistant: cba"
    summary = wandb_records.summary(tmp_path)
    assert summary["run/steps"] == 4 and summary["run/reward_last"] == 0.4 and "run/eval_last" not in summary
    assert next((tmp_path / "wandb").glob("offline-run-*/files/report.html")).is_file()


def test_a_resumed_run_continues_the_same_wandb_run_without_relogging(tmp_path):
    trainer = MetricsWriter(tmp_path, "trainer")
    trainer.log(1, {"loss": 2.0})
    first = WandbMirror(config(tmp_path))
    first.update()
    first.finish(None, None, failed=True)
    resumed = WandbMirror(config(tmp_path, resume=True))  # the launcher starts it before the processes
    trainer.log(2, {"loss": 1.0})  # what the resumed run adds
    resumed.update()
    resumed.finish(None, None, failed=False)
    assert len(wandb_records.offline_runs(tmp_path)) == 2
    assert len(wandb_records.run_ids(tmp_path)) == 1
    assert [r["trainer/step"] for r in wandb_records.history(tmp_path) if "trainer/loss" in r] == [1, 2]


def test_a_project_without_the_wandb_package_is_a_config_error(tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real_find_spec(name, *a))
    with pytest.raises(ValidationError, match="wandb.project[\\s\\S]*pip install 'tandem-rl\\[wandb\\]'"):
        config(tmp_path)
    assert RLConfig.model_validate({"output_dir": str(tmp_path)}).wandb.project is None
