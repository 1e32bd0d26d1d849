"""`metrics.jsonl`: one JSON object per line, appended by every process of a run.

Each line carries `process`, `step` and a wall-clock `time`. Lines are written with one
`write()` on a file opened with O_APPEND, so lines of concurrent processes never interleave.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    from tandem.monitor.prometheus import LatestMetrics

from tandem.transport.files import atomic_write_text

METRICS_FILE = "metrics.jsonl"


class MetricsWriter:
    def __init__(self, run_dir: Path, process: str, exporter: LatestMetrics | None = None):
        self.path = Path(run_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.process = process
        self.exporter = exporter
        """Also shows each logged step on Prometheus `/metrics` (`tandem.monitor.prometheus`)."""

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"process": self.process, "step": step, "time": time.time(), **{k: _clean(v) for k, v in metrics.items()}}
        line = (json.dumps(record) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
        if self.exporter is not None:
            self.exporter.record(step, metrics)


def truncate_metrics(run_dir: Path, step: int) -> int:
    """Drop the records of steps after `step` (a resume recomputes them), atomically; returns how many."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return 0
    kept, num_dropped = [], 0
    for line in path.read_text().splitlines(keepends=True):
        try:
            record_step = json.loads(line).get("step")
        except json.JSONDecodeError:
            num_dropped += 1  # a torn last line of the stopped run
            continue
        if isinstance(record_step, int) and record_step > step:
            num_dropped += 1
        else:
            kept.append(line if line.endswith("\n") else line + "\n")
    if num_dropped:
        atomic_write_text(path, "".join(kept))
    return num_dropped


def read_metrics(run_dir: Path, process: str | None = None) -> Iterator[dict[str, Any]]:
    """Records of the run, optionally of one process; a torn last line is skipped."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if process is None or record.get("process") == process:
            yield record


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null (so a NaN step stays visible, not a crash)."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
