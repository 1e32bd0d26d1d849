"""Config of supervised fine-tuning (`tandem sft`).

SFT shares the trainer's sections (device, optimizer, schedule, parallelism, checkpoints, weight
publishing) and writes the same `weights/step_N/` folders, so an RL run can start from them.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from tandem.config.base import Section
from tandem.config.trainer import TrainingProcessConfig


class SFTDataConfig(Section):
    path: Path
    """Training data: a `.jsonl` or `.parquet` file of rows with `messages` (chat) or `prompt` and `completion`."""

    loss_roles: list[str] = ["assistant"]
    """Chat rows: messages of these roles are the loss tokens (their header `<|im_start|>role` excluded for assistant)."""

    eval_path: Path | None = None
    """Held-out data in the same format, for the eval loss."""

    eval_fraction: float = Field(0.0, ge=0, lt=1)
    """Without `eval_path`: hold out this fraction of `path` (a seeded random choice) for the eval loss."""

    rows_per_step: int = Field(8, ge=1)
    """Packed rows (micro-batches of up to `seq_len` tokens) per optimizer step over all ranks; a multiple of the world size."""

    shuffle: bool = True
    """Shuffle the samples every epoch (seeded by `seed` and the epoch)."""


class EvalConfig(Section):
    interval: int = Field(0, ge=0)
    """Compute the eval loss every `interval` steps and after the last one; 0 disables it."""


class SFTConfig(TrainingProcessConfig):
    """Root config of supervised fine-tuning."""

    data: SFTDataConfig
    """Training and eval data."""

    eval: EvalConfig = EvalConfig()
    """Eval loss."""

    clean: bool = False
    """Delete an earlier run in `output_dir` before starting. A folder that holds one is refused unless this
    or `ckpt.resume` (continue it) is set."""

    @model_validator(mode="after")
    def _check_eval(self) -> "SFTConfig":
        if self.eval.interval and self.data.eval_path is None and self.data.eval_fraction == 0:
            raise ValueError("`eval.interval` is set but there is no eval data: set `data.eval_path` or `data.eval_fraction`")
        if self.clean and self.ckpt.resume:
            raise ValueError("`clean` and `ckpt.resume` exclude each other: choose one")
        if self.lora.share_base:
            raise ValueError("`lora.share_base` shares the base with an RL run's inference servers; SFT has none: "
                             "remove it")
        return self
