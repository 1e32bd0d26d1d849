"""The live line per step that `tandem rl` prints, read from `metrics.jsonl` as it grows."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from tandem.monitor.metrics import METRICS_FILE


class ProgressPrinter:
    """Prints one line per completed step: reward, eval reward, tokens/s, lag, waiting times."""

    def __init__(self, run_dir: Path, max_steps: int, stream=None):
        self.path = Path(run_dir) / METRICS_FILE
        self.max_steps = max_steps
        self.stream = stream or sys.stdout
        self._offset = 0
        self._orch: dict[int, dict[str, Any]] = {}
        self._trainer: dict[int, dict[str, Any]] = {}
        self._printed: set[int] = set()
        self._last_eval: float | None = None
        self._start = time.monotonic()

    def update(self) -> None:
        for record in self._new_records():
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

    def _new_records(self):
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
        print(" | ".join(parts), file=self.stream, flush=True)

    def finish(self) -> None:
        self.update()
        print(f"done: {len(self._printed)} steps in {time.monotonic() - self._start:.0f} s", file=self.stream, flush=True)


def _kl_part(trainer: dict[str, Any]) -> str:
    """The trainer-inference mismatch KL when the step had on-policy tokens, else the off-policy KL
    (mismatch plus the policy's drift since sampling, an upper bound of the mismatch in practice)."""
    if trainer.get("mismatch_kl") is not None:
        return f"mismatch_kl {_fmt(trainer['mismatch_kl'], '.1e')}"
    return f"off_policy_kl {_fmt(trainer.get('off_policy_kl'), '.1e')}"


def _fmt(value: Any, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)
