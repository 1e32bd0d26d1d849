"""Base classes of every tandem config.

A `Section` is a strict pydantic model: unknown keys are errors and every field's docstring
becomes its description (shown by `--help` and the docs). A `ProcessConfig` is the root config
of one process; it carries the fields an RL run shares between its three processes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator


class Section(BaseModel):
    """A config section: strict keys, attribute docstrings as descriptions."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True)


def default_type_tag(default: str) -> Discriminator:
    """Discriminate a union of sections on `type`, taking `default` when it is absent (`--optim.lr 1e-5`
    alone keeps AdamW)."""

    def pick(value: Any) -> str:
        return value.get("type", default) if isinstance(value, dict) else getattr(value, "type", default)

    return Discriminator(pick)


class ModelConfig(Section):
    name: str = "Qwen/Qwen3-0.6B"
    """A Hugging Face model folder or hub name (a hub name needs network access)."""

    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Parameter dtype: `auto` is bfloat16 on CUDA and float32 on CPU."""

    trust_remote_code: bool = False
    """Passed to transformers when a model falls back to `AutoModelForCausalLM`."""


class RunConfig(Section):
    name: str = "default"
    """Run name; the run folder defaults to `outputs/<name>`."""


class ProcessConfig(Section):
    """Root of one process's config. Its shared fields are set once by `tandem rl`."""

    model: ModelConfig = ModelConfig()
    """The policy model."""

    run: RunConfig = RunConfig()
    """Run identity."""

    seq_len: int = 2048
    """Maximum tokens of one packed training row (and of one sample)."""

    max_steps: int = 100
    """Number of training steps of the run."""

    output_dir: Path | None = None
    """The run folder; defaults to `outputs/<run.name>`."""

    seed: int = 0
    """Base seed of every random choice of the run."""

    @property
    def run_dir(self) -> Path:
        """The run folder, resolved from `output_dir` or `run.name`."""
        return self.output_dir if self.output_dir is not None else Path("outputs") / self.run.name


SHARED_FIELDS = ("model", "run", "seq_len", "max_steps", "output_dir", "seed")
"""Fields of `ProcessConfig` that `tandem rl` sets once for all three processes."""
