"""Config of `tandem replay RUN_DIR --step N [--loss.KEY VALUE ...]`: recompute one trained step offline.

The run's own trainer config is read from `RUN_DIR/configs/trainer.toml` (the launcher writes it,
and so does the trainer when it starts); replay never guesses it. `--loss.*` flags describe a second
loss to compare with the run's: they apply on top of the run's loss section, so `--loss.delta 4` keeps
the run's loss type, and `--loss.type ppo_clip` starts from that type's defaults.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from tandem.config.base import Section
from tandem.config.loader import ConfigError, load_toml, read_args, validate
from tandem.config.trainer import LossConfig, TrainerConfig

TRAINER_CONFIG = Path("configs") / "trainer.toml"
"""Where a run folder records its trainer's resolved config."""


class ReplayConfig(Section):
    """Root config of `tandem replay`. The run folder is the first argument: `tandem replay RUN_DIR --step N`."""

    run_dir: Path
    """The run folder to replay from (it holds `configs/trainer.toml`, `rollouts/` and `weights/`)."""

    step: int = Field(ge=1)
    """The step to recompute: its batch `rollouts/step_N/` on the policy it trained, `weights/step_{N-1}/`
    (the run's `model.name` for step 1)."""

    device: Literal["cpu", "cuda"] = "cpu"
    """Where to recompute; the CPU is enough for small models."""

    loss: LossConfig | None = None
    """A second loss to compute on the same tokens, beside the run's (keys missing here keep the run's values
    when the type is the run's); unset: the run's loss only."""


def read_run_trainer_config(run_dir: Path) -> TrainerConfig:
    """The trainer config the run trained with."""
    path = Path(run_dir) / TRAINER_CONFIG
    if not path.is_file():
        raise ConfigError(f"{path} not found: `tandem replay` reads the run's trainer config there "
                          "(written by `tandem rl` and by `tandem trainer` when they start)")
    return validate(TrainerConfig, load_toml(path), {})


def parse_replay_args(argv: list[str]) -> ReplayConfig:
    """`RUN_DIR --step N [--loss.KEY VALUE ...] [--device cpu]`, the loss overrides merged onto the run's loss."""
    if not argv or argv[0].startswith("-") or argv[0].startswith("@"):
        raise ConfigError("usage: tandem replay RUN_DIR --step N [--loss.type TYPE --loss.KEY VALUE ...] [--device cpu|cuda]")
    raw = read_args(ReplayConfig, ["--run-dir", argv[0], *argv[1:]], environ={})
    if "loss" in raw.data:
        raw.data["loss"] = _over_run_loss(read_run_trainer_config(Path(argv[0])), raw.data["loss"])
    return validate(ReplayConfig, raw.data, raw.sources)


def _over_run_loss(run: TrainerConfig, overrides: dict[str, Any]) -> dict[str, Any]:
    """The run's loss section with `overrides` on top, unless they name another loss type."""
    run_loss = run.loss.model_dump()
    if overrides.get("type", run_loss["type"]) != run_loss["type"]:
        return overrides
    return {**run_loss, **overrides}
