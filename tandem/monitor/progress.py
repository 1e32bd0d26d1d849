"""What `tandem rl` shows while it runs, read from `metrics.jsonl` as it grows: one line per RL step and,
on a terminal, a progress bar with rate and time left (in files and pipes, a plain line now and then instead)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from tandem.monitor.metrics import METRICS_FILE

PLAIN_INTERVAL_S = 30.0
"""Off a terminal, seconds between two plain progress lines."""


class MetricsFollower:
    """The records appended to a run folder's `metrics.jsonl` since the last call."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / METRICS_FILE
        self._offset = 0

    def skip_existing(self) -> None:
        """Start after the records the file holds now."""
        self._offset = self.path.stat().st_size if self.path.is_file() else 0

    def new_records(self) -> Iterator[dict[str, Any]]:
        if not self.path.is_file():
            return
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next poll
        self._offset += end
        for line in data[:end].splitlines():
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


class StepBar:
    """Steps done out of `total`, with rate and time left: a rich bar on a terminal, where `print` writes
    above it; elsewhere a plain line every `plain_every_s` seconds and at the end (None: no plain lines,
    for callers that print a line per step anyway)."""

    def __init__(self, label: str, total: int, stream=None, plain_every_s: float | None = PLAIN_INTERVAL_S,
                 unit: str = "step"):
        self.label, self.total, self.stream, self.unit = label, total, stream or sys.stdout, unit
        self.plain_every_s = plain_every_s
        self.done = 0
        self._start = self._last_plain = time.monotonic()
        self._progress = None
        if self.stream.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
                                      TextColumn("left"), TimeRemainingColumn(), console=Console(file=self.stream))
            self._task = self._progress.add_task(label, total=total, rate="")
            self._progress.start()

    def print(self, line: str) -> None:
        if self._progress is not None:
            self._progress.console.print(line, markup=False, highlight=False)
        else:
            print(line, file=self.stream, flush=True)

    def update(self, done: int) -> None:
        self.done = max(self.done, done)
        if self._progress is not None:
            self._progress.update(self._task, completed=self.done, rate=self._rate())
        elif self.plain_every_s is not None and time.monotonic() - self._last_plain >= self.plain_every_s:
            self._plain()

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        elif self.plain_every_s is not None:
            self._plain()

    def _rate(self) -> str:
        elapsed = time.monotonic() - self._start
        return f"{self.done / elapsed:.2f} {self.unit}s/s" if elapsed > 0 and self.done else ""

    def _plain(self) -> None:
        self._last_plain = time.monotonic()
        print(f"{self.label}: {self.unit} {self.done}/{self.total} ({self._rate() or f'no {self.unit} yet'}, "
              f"{self._last_plain - self._start:.0f} s)", file=self.stream, flush=True)


@contextmanager
def bar_once_total_known(label: str, unit: str, stream=None) -> Iterator[Callable[[int, int], None]]:
    """`progress(done, total)` for work whose total is known only once it reports: the `StepBar` is made at the
    first report and closed however the work ends."""
    bar: StepBar | None = None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        bar = bar or StepBar(label, total, stream or sys.stderr, unit=unit)
        bar.update(done)
    try:
        yield progress
    finally:
        if bar is not None:
            bar.close()


class ProgressPrinter:
    """Prints one line per completed step: reward, eval reward, tokens/s, lag, waiting times."""

    def __init__(self, run_dir: Path, max_steps: int, stream=None):
        self.metrics = MetricsFollower(run_dir)
        self.max_steps = max_steps
        self.bar = StepBar("rl", max_steps, stream, plain_every_s=None)
        self._orch: dict[int, dict[str, Any]] = {}
        self._trainer: dict[int, dict[str, Any]] = {}
        self._printed: set[int] = set()
        self._last_eval: float | None = None
        self._start = time.monotonic()

    def update(self) -> None:
        for record in self.metrics.new_records():
            step = record.get("step", 0)
            process = record.get("process")
            if process == "orchestrator":
                self._orch.setdefault(step, {}).update(record)
                if record.get("eval/reward_mean") is not None:
                    self._last_eval = record["eval/reward_mean"]
            elif process == "trainer":
                self._trainer.setdefault(step, {}).update(record)
        for step in sorted(set(self._orch) & set(self._trainer) - self._printed):
            self._print_step(step, self._orch[step], self._trainer[step])
        self.bar.update(len(self._printed))

    def _print_step(self, step: int, orch: dict[str, Any], trainer: dict[str, Any]) -> None:
        self._printed.add(step)
        parts = [f"step {step:>4}/{self.max_steps}", f"reward {_fmt(orch.get('reward/mean'))}"]
        if self._last_eval is not None:
            parts.append(f"eval {_fmt(self._last_eval)}")
        parts += [
            f"loss {_fmt(trainer.get('loss'), '.4f')}",
            _kl_part(trainer),
            f"train {_fmt(trainer.get('tokens_per_s'), '.0f')} tok/s",
            f"lag {_fmt(orch.get('off_policy/mean'), '.2f')}",
            f"wait trainer {_fmt(trainer.get('time_wait_batch'), '.1f')}s",
            f"wait inference {_fmt(orch.get('time/wait_inference_s'), '.1f')}s",
            f"{time.monotonic() - self._start:.0f}s",
        ]
        self.bar.print(" | ".join(parts))

    def finish(self) -> None:
        """The run ended well: its last steps and a closing line."""
        self.update()
        self.bar.print(f"done: {len(self._printed)} steps in {time.monotonic() - self._start:.0f} s")

    def close(self) -> None:
        """Take the bar off the terminal (after `finish`, or when the run failed)."""
        self.bar.close()


def _kl_part(trainer: dict[str, Any]) -> str:
    """The trainer-inference mismatch KL when the step had on-policy tokens, else the off-policy KL
    (mismatch plus the policy's drift since sampling, an upper bound of the mismatch in practice)."""
    if trainer.get("mismatch_kl") is not None:
        return f"mismatch_kl {_fmt(trainer['mismatch_kl'], '.1e')}"
    return f"off_policy_kl {_fmt(trainer.get('off_policy_kl'), '.1e')}"


def _fmt(value: Any, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)
