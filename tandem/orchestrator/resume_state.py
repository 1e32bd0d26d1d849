"""The orchestrator's own checkpoint: which step it finished and where its data stream stands.

A checkpoint is one JSON file, `checkpoints/step_N/orchestrator/state.json`, written atomically,
so a folder holding it is complete. Resuming from step N produces batches N+1, N+2, ...; tasks
drawn for groups that were still in flight at step N are skipped (they were never trained on).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tandem.transport.files import atomic_write_text
from tandem.transport.paths import CHECKPOINT_COMPLETE, checkpoint_dir, complete_checkpoint_steps

PROCESS = "orchestrator"
STATE_FILE = CHECKPOINT_COMPLETE[PROCESS]


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any]) -> Path:
    path = checkpoint_dir(run_dir, step, PROCESS) / STATE_FILE
    atomic_write_text(path, json.dumps({"step": step, **state}, indent=1))
    return path


def load_checkpoint(run_dir: Path, step: int | None = None) -> dict[str, Any] | None:
    """The state of the complete orchestrator checkpoint of `step` (None: the newest), or None if there is none."""
    steps = complete_checkpoint_steps(run_dir, PROCESS)
    if step is None and steps:
        step = steps[-1]
    if step not in steps:
        return None
    return json.loads((checkpoint_dir(run_dir, step, PROCESS) / STATE_FILE).read_text())
