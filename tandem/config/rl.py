"""The RL config: the three process configs plus the fields they share.

`resolve()` is the one explicit step that copies the shared fields into the sub-configs; a
sub-config that sets a shared field to another value is an error, not a silent override.
"""

from __future__ import annotations

from pydantic import model_validator

from tandem.config.base import ModelConfig, ProcessConfig, RunConfig
from tandem.config.inference import InferenceConfig
from tandem.config.orchestrator import OrchestratorConfig
from tandem.config.trainer import TrainerConfig
from tandem.config.loader import ConfigError

SHARED_KEYS = ("model.name", "run.name", "seq_len", "max_steps", "output_dir", "seed")
"""Dotted keys that `tandem rl` sets once for all three processes."""


class RLConfig(ProcessConfig):
    trainer: TrainerConfig = TrainerConfig()
    """The RL trainer."""

    orchestrator: OrchestratorConfig = OrchestratorConfig()
    """The orchestrator."""

    inference: InferenceConfig = InferenceConfig()
    """The inference server."""

    @model_validator(mode="after")
    def _propagate_shared(self) -> "RLConfig":
        for name in ("trainer", "orchestrator", "inference"):
            propagate_shared(self, getattr(self, name), name)
        return self


def propagate_shared(root: ProcessConfig, sub: ProcessConfig, sub_name: str) -> None:
    """Copy every shared key of `root` into `sub`; raise if `sub` set one to another value."""
    for key in SHARED_KEYS:
        *path, leaf = key.split(".")
        src, dst = root, sub
        for part in path:
            src, dst = getattr(src, part), getattr(dst, part)
        value = getattr(src, leaf)
        if leaf in dst.model_fields_set and getattr(dst, leaf) != value:
            raise ValueError(
                f"`{sub_name}.{key}` = {getattr(dst, leaf)!r} contradicts the shared `{key}` = {value!r}; "
                f"set only the shared `{key}`"
            )
        # object.__setattr__ keeps `model_fields_set` as the user wrote it.
        object.__setattr__(dst, leaf, value)


__all__ = ["RLConfig", "SHARED_KEYS", "propagate_shared", "ModelConfig", "RunConfig", "ConfigError"]
