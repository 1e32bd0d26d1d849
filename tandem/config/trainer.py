"""Config of the RL trainer (`tandem trainer`)."""

from __future__ import annotations

from tandem.config.base import ProcessConfig


class TrainerConfig(ProcessConfig):
    """Root config of the RL trainer."""
