"""Weights & Biases: the run folder's figures and rollouts, mirrored into one W&B run by the launcher.

Why the launcher and not each process: orchestrator and trainer already write every figure to
`metrics.jsonl` and every rollout to `samples.jsonl` (the run folder is their wire format). One reader
of that folder logs them all into one W&B run, so no process needs W&B or a network, two writers never
race on one W&B run, and W&B sees exactly what the report and Prometheus see.

Each process's figures go under its name (`trainer/loss`, `orchestrator/reward/mean`) against its own
step axis (`trainer/step`, `orchestrator/step`): the orchestrator runs ahead of the trainer, and W&B's
global step only moves forward. Rollout tables: `orchestrator/samples` every `samples_interval` steps,
`orchestrator/eval_samples` at each eval. A resumed run (`--resume`) continues the same W&B run (W&B cannot
take back what it logged: steps after the checkpoint resumed from appear twice).
"""

from __future__ import annotations

import json
import numbers
import secrets
import sys
from pathlib import Path
from typing import Any

from tandem.config.rl import RLConfig
from tandem.config.secret import redacted_dump, secrets_of
from tandem.monitor.progress import MetricsFollower
from tandem.transport.files import atomic_write_text
from tandem.transport.paths import rollouts_dir

RUN_ID_FILE = "wandb/tandem-run-id"
"""Under the run folder: the W&B run id, so that `--resume` logs into the same W&B run."""

SAMPLE_COLUMNS = ["step", "env", "status", "reward", "advantage", "prompt", "completion", "stop_reason", "error"]


class WandbMirror:
    """Logs what the run folder gains, each time `update` is called, into one W&B run."""

    def __init__(self, config: RLConfig):
        import wandb

        self._wandb = wandb
        self.run_dir = config.run_dir
        self.settings = config.wandb
        self.metrics = MetricsFollower(self.run_dir)
        run_id, resumed = self._run_id(config.resume)
        # W&B's metadata of a run holds this process's command line: not when a secret is on it (a flag's value).
        secret_on_command_line = any(value in " ".join(sys.argv) for value in secrets_of(config).values())
        self.run = wandb.init(
            project=self.settings.project, entity=self.settings.entity, name=self.settings.name or config.run.name,
            group=self.settings.group, tags=self.settings.tags or None, mode=self.settings.mode, dir=self.run_dir,
            id=run_id, resume="allow", config=redacted_dump(config),
            settings=wandb.Settings(console="off", quiet=True, disable_git=True, save_code=False,
                                    x_disable_meta=secret_on_command_line),
        )
        for process in ("orchestrator", "trainer"):
            self.run.define_metric(f"{process}/step")
            self.run.define_metric(f"{process}/*", step_metric=f"{process}/step")
        if resumed:
            self.metrics.skip_existing()  # the earlier W&B run holds the steps kept by the resume cut
        self._pending_tables: dict[tuple[str, int], Path] = {}

    def _run_id(self, resume: bool) -> tuple[str, bool]:
        path = self.run_dir / RUN_ID_FILE
        if resume and path.is_file():
            return path.read_text().strip(), True
        run_id = secrets.token_hex(6)  # W&B ids: lowercase letters and digits
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, run_id)
        return run_id, False

    def update(self) -> None:
        for record in self.metrics.new_records():
            self._log_record(record)
        self._log_ready_tables()

    def _log_record(self, record: dict[str, Any]) -> None:
        process, step = record.get("process"), record.get("step")
        if process not in ("orchestrator", "trainer") or not isinstance(step, int):
            return  # SFT and eval-only runs log to their own files; only the RL processes are mirrored
        figures = {f"{process}/{key}": value for key, value in record.items()
                   if key not in ("process", "step", "time") and isinstance(value, numbers.Number)}
        self.run.log({f"{process}/step": step, **figures})
        if process != "orchestrator" or not self.settings.samples_interval:
            return
        if "eval/reward_mean" in record:
            self._pending_tables[("eval_samples", step)] = self.run_dir / "eval" / f"step_{step}" / "samples.jsonl"
        if "reward/mean" in record and step % self.settings.samples_interval == 0:
            self._pending_tables[("samples", step)] = rollouts_dir(self.run_dir, step) / "samples.jsonl"

    def _log_ready_tables(self) -> None:
        """Tables whose `samples.jsonl` is written (it may land after the step's figures)."""
        for (name, step), path in sorted(self._pending_tables.items(), key=lambda item: item[0][1]):
            if path.is_file():
                del self._pending_tables[(name, step)]
                table = self._wandb.Table(columns=SAMPLE_COLUMNS, data=sample_rows(path, step, self.settings.max_samples))
                self.run.log({"orchestrator/step": step, f"orchestrator/{name}": table})

    def finish(self, summary: dict[str, Any] | None, report: Path | None, failed: bool) -> None:
        """Close the W&B run: the run's headline numbers as its summary, `report.html` among its files."""
        self.update()
        if summary:
            self.run.summary.update({f"run/{k}": v for k, v in summary.items() if v is not None})
        if report is not None and report.is_file():
            self.run.save(str(report), base_path=str(report.parent), policy="now")
        self.run.finish(exit_code=1 if failed else 0)


def sample_rows(path: Path, step: int, limit: int) -> list[list[Any]]:
    """The first `limit` rollouts of a `samples.jsonl` as table rows (prompts and completions as text)."""
    rows = []
    for line in path.read_text().splitlines()[:limit]:
        record = json.loads(line)
        rows.append([step, record.get("env"), record.get("status"), record.get("reward"), record.get("advantage"),
                     as_text(record.get("prompt")), as_text(record.get("completion")), record.get("stop_reason"),
                     record.get("error")])
    return rows


def as_text(value: Any) -> str:
    """Chat messages as `role: content` lines; anything else as its string."""
    if isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value):
        return "\n".join(f"{m['role']}: {m.get('content') or ''}" for m in value)
    return "" if value is None else str(value)
