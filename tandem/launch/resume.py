"""`tandem rl --resume`: the run folder cut back to the checkpoint that trainer and orchestrator resume from.

A stopped run leaves records of the steps after its newest checkpoint: metrics rows, rollouts and their
samples, published weights, evals, the newer half of a checkpoint pair. The resumed processes compute those
steps again, so the launcher removes the stale records before starting them. Invariant: after the cut, the
folder holds exactly what a run that stopped at the checkpoint's step holds, and the resumed run adds every
later step once, as a run that never stopped would.

Each removal is safe to interrupt: a folder loses the file that marks it complete (`STABLE`, `state.pt`,
`state.json`) before anything else, and `metrics.jsonl` is replaced by rename. Running the cut again
finishes it.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from tandem.monitor.metrics import truncate_metrics
from tandem.transport.paths import CHECKPOINT_COMPLETE, STABLE, common_checkpoint_steps

STEP_FOLDERS = {"rollouts": (), "weights": (STABLE,), "eval": ()}
"""Run-folder parts with one `step_N` folder per step, and the files that mark such a folder complete."""


def resume_step(run_dir: Path) -> int:
    """The newest step with both checkpoint halves complete (0: none, the run starts over)."""
    return max(common_checkpoint_steps(run_dir), default=0)


def cut_run_records(run_dir: Path, step: int) -> list[str]:
    """Remove every record of the steps after `step`; returns what was removed (run-folder relative)."""
    run_dir = Path(run_dir)
    removed = []
    for part, markers in STEP_FOLDERS.items():
        for folder in _step_folders(run_dir / part, after=step):
            _remove(folder, markers)
            removed.append(f"{part}/{folder.name}")
    for folder in _step_folders(run_dir / "checkpoints", after=step):
        _remove(folder, tuple(f"{process}/{marker}" for process, marker in CHECKPOINT_COMPLETE.items()))
        removed.append(f"checkpoints/{folder.name}")
    num_rows = truncate_metrics(run_dir, step)
    if num_rows:
        removed.append(f"{num_rows} metrics.jsonl rows")
    report = run_dir / "report.html"
    if report.is_file():  # written again when the resumed run ends
        report.unlink()
        removed.append(report.name)
    return removed


def _step_folders(parent: Path, after: int) -> list[Path]:
    return [folder for step, folder in _numbered(parent) if step > after]


def _numbered(parent: Path) -> list[tuple[int, Path]]:
    if not parent.is_dir():
        return []
    found = [(re.fullmatch(r"step_(\d+)", p.name), p) for p in parent.iterdir() if p.is_dir()]
    return sorted((int(match.group(1)), p) for match, p in found if match)


def _remove(folder: Path, markers: tuple[str, ...]) -> None:
    for marker in markers:
        (folder / marker).unlink(missing_ok=True)
    shutil.rmtree(folder)
