"""Config of the orchestrator (`tandem orchestrator`)."""

from __future__ import annotations

from tandem.config.base import ProcessConfig


class OrchestratorConfig(ProcessConfig):
    """Root config of the orchestrator."""
