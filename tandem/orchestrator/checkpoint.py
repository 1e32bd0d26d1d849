"""The orchestrator's own checkpoint: which step it finished and where its data stream stands.

A checkpoint is one JSON file, `checkpoints/step_N/orchestrator/state.json`, written atomically,
so a folder holding it is complete. Resuming from step N produces batches N+1, N+2, ...; tasks
drawn for groups that were still in flight at step N are skipped (they were never trained on).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from tandem.transport.files import atomic_write_text
from tandem.transport.paths import checkpoint_dir

STATE_FILE = "state.json"
PROCESS = "orchestrator"


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any]) -> Path:
    path = checkpoint_dir(run_dir, step, PROCESS) / STATE_FILE
    atomic_write_text(path, json.dumps({"step": step, **state}, indent=1))
    return path


def latest_checkpoint(run_dir: Path) -> dict[str, Any] | None:
    """The state of the newest complete orchestrator checkpoint, or None."""
    steps = []
    for folder in (Path(run_dir) / "checkpoints").glob("step_*"):
        match = re.fullmatch(r"step_(\d+)", folder.name)
        if match and (folder / PROCESS / STATE_FILE).is_file():
            steps.append(int(match.group(1)))
    if not steps:
        return None
    return json.loads((checkpoint_dir(run_dir, max(steps), PROCESS) / STATE_FILE).read_text())
