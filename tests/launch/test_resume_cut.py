"""The cut `tandem rl --resume` makes: which checkpoint it resumes from, what it removes, in what order."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.launch.resume import STEP_FOLDERS, cut_run_records, resume_step
from tandem.monitor.metrics import MetricsWriter, read_metrics
from tandem.transport.paths import STABLE


def stopped_run(run: Path, trainer_ckpts: list[int], orchestrator_ckpts: list[int], last_step: int) -> None:
    """A run folder as a run stopped after `last_step` leaves it (files hold placeholders)."""
    for step in trainer_ckpts:
        (run / "checkpoints" / f"step_{step}" / "trainer").mkdir(parents=True)
        (run / "checkpoints" / f"step_{step}" / "trainer" / "state.pt").write_bytes(b"x")
        (run / "checkpoints" / f"step_{step}" / "trainer" / "__0_0.distcp").write_bytes(b"x")
    for step in orchestrator_ckpts:
        (run / "checkpoints" / f"step_{step}" / "orchestrator").mkdir(parents=True, exist_ok=True)
        (run / "checkpoints" / f"step_{step}" / "orchestrator" / "state.json").write_text("{}")
    for step in range(1, last_step + 1):
        for part, name in (("rollouts", "rank_0.msgpack"), ("rollouts", "samples.jsonl"), ("weights", STABLE),
                           ("weights", "model.safetensors")):
            (run / part / f"step_{step}").mkdir(parents=True, exist_ok=True)
            (run / part / f"step_{step}" / name).write_bytes(b"x")
        for process in ("orchestrator", "trainer"):
            MetricsWriter(run, process).log(step, {"loss": 0.5})
    (run / "eval" / f"step_{last_step}").mkdir(parents=True)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"process": "trainer", "step": 9')  # torn by the kill
    (run / "report.html").write_text("<html>")


def test_resume_is_from_the_newest_step_both_processes_checkpointed(tmp_path):
    stopped_run(tmp_path, trainer_ckpts=[2, 4], orchestrator_ckpts=[2, 4, 6], last_step=7)
    assert resume_step(tmp_path) == 4
    assert resume_step(tmp_path / "empty") == 0


def test_the_cut_removes_every_record_after_the_step_and_nothing_before(tmp_path):
    stopped_run(tmp_path, trainer_ckpts=[2, 4], orchestrator_ckpts=[2, 4, 6], last_step=7)
    removed = cut_run_records(tmp_path, 4)
    assert removed == ["rollouts/step_5", "rollouts/step_6", "rollouts/step_7", "weights/step_5", "weights/step_6",
                       "weights/step_7", "eval/step_7", "checkpoints/step_6", "7 metrics.jsonl rows", "report.html"]
    assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == ["step_1", "step_2", "step_3", "step_4"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_2", "step_4"]
    rows = list(read_metrics(tmp_path))
    assert [(r["process"], r["step"]) for r in rows] == [(p, s) for s in range(1, 5) for p in ("orchestrator", "trainer")]
    assert (tmp_path / "metrics.jsonl").read_text().endswith("\n")
    assert cut_run_records(tmp_path, 4) == []  # done: a second cut finds nothing


def test_an_interrupted_cut_leaves_no_folder_a_resume_would_trust(tmp_path, monkeypatch):
    stopped_run(tmp_path, trainer_ckpts=[2, 4], orchestrator_ckpts=[2, 4], last_step=4)
    import tandem.launch.resume as resume

    real_rmtree, interrupted = resume.shutil.rmtree, []

    def rmtree_or_die(folder):
        if folder.name == "step_4" and folder not in interrupted:  # the launcher stops between unmarking a folder and deleting it
            interrupted.append(folder)
            raise KeyboardInterrupt
        real_rmtree(folder)

    monkeypatch.setattr(resume.shutil, "rmtree", rmtree_or_die)
    for part in (*STEP_FOLDERS, "checkpoints"):
        with pytest.raises(KeyboardInterrupt):
            cut_run_records(tmp_path, 2)
        assert interrupted[-1] == tmp_path / part / "step_4"
        if part == "weights":  # no reader takes half-removed weights
            assert (tmp_path / "weights" / "step_4" / "model.safetensors").exists()
            assert not (tmp_path / "weights" / "step_4" / STABLE).exists()
    assert (tmp_path / "checkpoints" / "step_4" / "trainer" / "__0_0.distcp").exists()
    assert resume_step(tmp_path) == 2  # nor half of checkpoint 4
    monkeypatch.undo()
    cut_run_records(tmp_path, 2)  # the next resume finishes the cut
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_2"]
    assert max(r["step"] for r in read_metrics(tmp_path)) == 2
