"""Base classes of every tandem config.

A `Section` is a strict pydantic model: unknown keys are errors and every field's docstring
becomes its description (shown by `--help` and the docs). A `ProcessConfig` is the root config
of one process; it carries the fields an RL run shares between its three processes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field


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

    load_format: Literal["safetensors", "dummy"] = "safetensors"
    """`dummy`: random weights made on the device instead of read from the folder (native models only;
    the same values in the trainer and the engine), for benchmarks of real shapes whose weights were
    never written (`tandem model init --config-only`)."""


class CheckpointConfig(Section):
    """When a process checkpoints. `tandem rl` sets these keys once for trainer and orchestrator,
    so that both hold checkpoints of the same steps and resume together."""

    enabled: bool = False
    """Checkpoint every `interval` steps, so that the run can resume."""

    interval: int = Field(10, ge=1)
    """Steps between checkpoints."""


class ProcessCheckpointConfig(CheckpointConfig):
    """One process's checkpoints, under `checkpoints/step_N/<process>/`, and where it resumes."""

    resume: bool = False
    """Continue from a complete checkpoint of this process in the run folder."""

    resume_step: int | None = Field(None, ge=1)
    """With `resume`: the step of the checkpoint to resume from; unset: the newest complete one.
    `tandem rl --resume` sets it to the newest step that trainer and orchestrator both checkpointed."""


class PrometheusConfig(Section):
    """Prometheus `/metrics` of a process: the latest value of each metric it writes to `metrics.jsonl`."""

    port: int | None = Field(None, ge=1, le=65535)
    """Serve the latest value of each metric this process logs at `http://<host>:<port>/metrics` (Prometheus
    format, names in `docs/deployment.md`); unset: off. The inference server has `/metrics` on its own port."""

    host: str = "127.0.0.1"
    """Address to bind; loopback by default so a run never listens on the network unasked."""


class RunConfig(Section):
    name: str = "default"
    """Run name; the run folder defaults to `outputs/<name>`."""

    exact: bool = False
    """Bitwise parity of engine and trainer: both compute every token with batch-invariant kernels
    (`tandem.models.exact`), so on-policy tokens get importance ratio 1 and mismatch KL 0 exactly.
    Native models with the `tandem` backend. On CUDA, Triton kernels (dense blocks): the engine somewhat
    slower than by default, the trainer several times slower (`benchmarks/results/exact-h200-2026-12-05.json`,
    `benchmarks/results/trainer-h200-2026-12-05.json`); on the CPU and for a mixture of experts' blocks,
    token by token: far slower (one kernel call per token and op)."""


class ProcessConfig(Section):
    """Root of one process's config. Under `tandem rl`, these keys are set once at the top and
    shared by its three processes."""

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

