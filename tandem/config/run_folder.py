"""Create the run folder of ARCHITECTURE.md and record each process's resolved config."""

from __future__ import annotations

from pathlib import Path

from tandem.config.base import ProcessConfig
from tandem.config.dump import to_toml
from tandem.transport.files import atomic_write_text

RUN_SUBDIRS = ("configs", "logs", "rollouts", "weights", "checkpoints")


def prepare_run_folder(config: ProcessConfig, process: str) -> Path:
    """Make `outputs/<run>/` and its subfolders; write `configs/<process>.toml`. Idempotent."""
    run_dir = config.run_dir
    for sub in RUN_SUBDIRS:
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / "configs" / f"{process}.toml", to_toml(config))
    return run_dir
