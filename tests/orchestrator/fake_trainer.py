"""A stand-in for the trainer: reads each step's batch files and publishes the next policy.

For step N it waits for every `rank_R.msgpack`, records the newest published policy at that
moment (the async gate says it must be >= N-1-max_async_level), waits `delay_s` (the "training"),
then writes `weights/step_N/` and its `STABLE` marker, as the real trainer does.
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

from tandem.transport.paths import STABLE, latest_stable_step, rollout_file, weights_dir
from tandem.transport.types import TrainingBatch, decode_batch


class FakeTrainer(threading.Thread):
    def __init__(self, run_dir: Path, num_steps: int, num_ranks: int = 1, delay_s: float = 0.0,
                 weights_from: Path | None = None, first_step: int = 1):
        super().__init__(daemon=True)
        self.run_dir = Path(run_dir)
        self.num_steps = num_steps
        self.num_ranks = num_ranks
        self.delay_s = delay_s
        self.weights_from = weights_from
        """A model folder copied into each `weights/step_N` (for a real server); else an empty folder."""
        self.first_step = first_step
        self.batches: dict[int, list[TrainingBatch]] = {}
        self.policy_when_ready: dict[int, int] = {}
        self.error: BaseException | None = None
        self._halt = threading.Event()

    def run(self) -> None:
        try:
            for step in range(self.first_step, self.num_steps + 1):
                files = [rollout_file(self.run_dir, step, r) for r in range(self.num_ranks)]
                while not all(f.is_file() for f in files):
                    if self._halt.wait(0.005):
                        return
                self.policy_when_ready[step] = latest_stable_step(self.run_dir) or 0
                self.batches[step] = [decode_batch(f.read_bytes()) for f in files]
                time.sleep(self.delay_s)
                self.publish(step)
        except BaseException as err:  # surfaced by the test through `error`
            self.error = err

    def publish(self, step: int) -> None:
        folder = weights_dir(self.run_dir, step)
        if self.weights_from is not None:
            shutil.copytree(self.weights_from, folder, dirs_exist_ok=True)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / STABLE).touch()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=10)
