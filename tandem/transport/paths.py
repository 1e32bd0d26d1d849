"""Where the processes of a run meet on disk (the run folder of ARCHITECTURE.md).

Trainer writes `weights/step_N/` then an empty `STABLE` file; the orchestrator writes
`rollouts/step_N/rank_R.msgpack`. Both sides build these paths here and nowhere else.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

STABLE = "STABLE"

CHECKPOINT_COMPLETE = {"trainer": "state.pt", "orchestrator": "state.json"}
"""Process -> the file whose presence makes its `checkpoints/step_N/<process>/` complete (written last)."""


def weights_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "weights" / f"step_{step}"


def final_weights_dir(run_dir: Path) -> Path:
    """`weights/final`: a link to the last step's folder, made by SFT once its run is complete (an RL run starts from it)."""
    return Path(run_dir) / "weights" / "final"


def rollouts_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "rollouts" / f"step_{step}"


def rollout_file(run_dir: Path, step: int, rank: int) -> Path:
    return rollouts_dir(run_dir, step) / f"rank_{rank}.msgpack"


def preflight_dir(run_dir: Path) -> Path:
    """`preflight/`: the orchestrator's probe batch (`probe/rank_R.msgpack`) and `orchestrator.json`, the trainer's
    `trainer.json`, the launcher's report."""
    return Path(run_dir) / "preflight"


def probe_file(run_dir: Path, rank: int) -> Path:
    """The preflight's probe batch of one trainer rank (a `TrainingBatch` of step 0)."""
    return preflight_dir(run_dir) / "probe" / f"rank_{rank}.msgpack"


def preflight_orchestrator_report(run_dir: Path) -> Path:
    """The orchestrator's part of the preflight (JSON: turns, prefix breaks, problems, the probe's size, tokens/s)."""
    return preflight_dir(run_dir) / "orchestrator.json"


def preflight_trainer_report(run_dir: Path) -> Path:
    """The trainer's part of the preflight (JSON: mismatch KL, tokens/s, memory plan), written by rank 0."""
    return preflight_dir(run_dir) / "trainer.json"


def checkpoint_dir(run_dir: Path, step: int, process: str) -> Path:
    """`checkpoints/step_N/{trainer,orchestrator}/`."""
    return Path(run_dir) / "checkpoints" / f"step_{step}" / process


def complete_checkpoint_steps(run_dir: Path, process: str) -> list[int]:
    """Steps of the complete checkpoints of `process`, oldest first."""
    marker = CHECKPOINT_COMPLETE[process]
    steps = [_step_of(p) for p in (Path(run_dir) / "checkpoints").glob("step_*") if (p / process / marker).is_file()]
    return sorted(s for s in steps if s is not None)


def common_checkpoint_steps(run_dir: Path) -> list[int]:
    """Steps that every checkpointing process (`CHECKPOINT_COMPLETE`) checkpointed completely, oldest first:
    the steps a run can resume from."""
    steps = [set(complete_checkpoint_steps(run_dir, process)) for process in CHECKPOINT_COMPLETE]
    return sorted(set.intersection(*steps))


def is_stable(folder: Path) -> bool:
    return (Path(folder) / STABLE).is_file()


def latest_stable_step(run_dir: Path) -> int | None:
    """The newest step whose weights folder is complete, or None."""
    steps = [_step_of(p) for p in (Path(run_dir) / "weights").glob("step_*") if is_stable(p)]
    return max((s for s in steps if s is not None), default=None)


def _step_of(path: Path) -> int | None:
    match = re.fullmatch(r"step_(\d+)", path.name)
    return int(match.group(1)) if match else None


def broadcast_info_file(run_dir: Path, step: int) -> Path:
    """`broadcasts/step_N.json`: the `WeightUpdateInfo` of policy N, written by trainer rank 0 just
    before it sends the tensors over the broadcast group (the only file of that transport)."""
    return Path(run_dir) / "broadcasts" / f"step_{step}.json"


def announced_steps(run_dir: Path, after: int) -> list[int]:
    """The steps announced under `broadcasts/` that are newer than `after`, in order."""
    steps = [_step_of(p.with_suffix("")) for p in (Path(run_dir) / "broadcasts").glob("step_*.json")]
    return sorted(s for s in steps if s is not None and s > after)


def shared_base_file(run_dir: Path) -> Path:
    """`shared_base.json`: where the trainer's frozen base lies for the servers to map (`lora.share_base`; the
    format: `tandem.transport.shared_base`)."""
    return Path(run_dir) / "shared_base.json"


def shared_base_released_file(run_dir: Path) -> Path:
    """Written by a trainer that shares its base once its steps are done and it only holds the base for the
    servers: the launcher then counts it as finished, and stops it with them."""
    return Path(run_dir) / "shared_base.released"


def shared_buffer_file(run_dir: Path) -> Path | None:
    """The shared-memory file of a CPU trainer's shared base, as `shared_base.json` names it; None on CUDA or
    without one. The launcher removes it after the run: a trainer killed outright leaves it, the model's size."""
    record = shared_base_file(run_dir)
    if not record.is_file():
        return None
    path = json.loads(record.read_text()).get("buffer", {}).get("path")
    return Path(path) if path else None
