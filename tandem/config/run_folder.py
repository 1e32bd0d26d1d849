"""The run folder of ARCHITECTURE.md: create it and record each process's resolved config; tell whether it
already holds a run, and remove one.

A folder holds a run when it has `metrics.jsonl` or any `weights/`, `rollouts/`, `checkpoints/` or `eval/`
records, finished or not, of whatever config. The commands that write runs (`tandem rl`, `tandem sft`, the
SFT warm-up) never write into such a folder unless told to continue it (resume) or start over (clean).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tandem.config.base import ProcessConfig
from tandem.config.dump import to_toml
from tandem.transport.files import atomic_write_text

RUN_SUBDIRS = ("configs", "logs", "rollouts", "weights", "checkpoints")

RESULT_PARTS = ("metrics.jsonl", "weights", "rollouts", "checkpoints", "eval")
"""The records that make a folder hold a run (the file, or a folder with something in it)."""

RUN_PARTS = RESULT_PARTS + ("configs", "logs", "preflight", "broadcasts", "replay", "report.html")
"""Everything a run writes into its folder: what starting over removes."""


def results_in(run_dir: Path) -> list[str]:
    """The parts of `RESULT_PARTS` that `run_dir` holds; empty: it holds no run."""
    return [part for part in RESULT_PARTS if _holds_something(Path(run_dir) / part)]


def remove_run(run_dir: Path) -> None:
    """Remove every part of a run from `run_dir` (`RUN_PARTS`), leaving whatever else the folder holds."""
    for part in RUN_PARTS:
        path = Path(run_dir) / part
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink(missing_ok=True)


def _holds_something(path: Path) -> bool:
    return path.is_file() or (path.is_dir() and any(path.iterdir()))


def prepare_run_folder(config: ProcessConfig, process: str) -> Path:
    """Make `outputs/<run>/` and its subfolders; write `configs/<process>.toml`. Idempotent."""
    run_dir = config.run_dir
    for sub in RUN_SUBDIRS:
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / "configs" / f"{process}.toml", to_toml(config))
    return run_dir
