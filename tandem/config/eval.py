"""Config of `tandem eval`: score a model on environments' eval splits against inference servers."""

from __future__ import annotations

from pydantic import Field, model_validator

from tandem.config.base import ProcessConfig
from tandem.config.orchestrator import ClientConfig, EnvConfig, EvalSettings, SamplingConfig, check_envs


class EvalConfig(ProcessConfig):
    """Root config of `tandem eval`. Results go to `<run_dir>/eval/step_<step>/` and `metrics.jsonl`."""

    client: ClientConfig = ClientConfig()
    """The inference servers serving the model to evaluate."""

    sampling: SamplingConfig = SamplingConfig()
    """Sampling settings; `eval.temperature` overrides the temperature."""

    envs: list[EnvConfig] = Field(default_factory=lambda: [EnvConfig(id="reverse_text")])
    """Environments to evaluate (their `weight` is unused here)."""

    eval: EvalSettings = EvalSettings()
    """How many examples and rollouts, and what counts as a pass."""

    step: int = 0
    """Policy version the servers hold, recorded with the results."""

    max_concurrent_rollouts: int = 64
    """Most rollouts in flight at once, over all servers."""

    @model_validator(mode="after")
    def _check(self) -> "EvalConfig":
        check_envs(self.envs)
        if self.max_concurrent_rollouts < 1:
            raise ValueError(f"`max_concurrent_rollouts` must be >= 1, got {self.max_concurrent_rollouts}")
        return self
