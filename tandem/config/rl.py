"""The RL config: the three process configs plus the fields they share.

`resolve()` is the one explicit step that copies the shared fields into the sub-configs; a
sub-config that sets a shared field to another value is an error, not a silent override.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from tandem.config.base import ModelConfig, ProcessConfig, RunConfig, Section
from tandem.config.inference import InferenceConfig
from tandem.config.orchestrator import OrchestratorConfig
from tandem.config.trainer import TrainerConfig
from tandem.config.weight_transport import FilesystemWeightTransport, WeightTransportConfig
from tandem.config.loader import ConfigError

SHARED_KEYS = ("model.name", "run.name", "seq_len", "max_steps", "output_dir", "seed")
"""Dotted keys that `tandem rl` sets once for all three processes."""

CKPT_KEYS = ("ckpt.enabled", "ckpt.interval")
"""Checkpoint keys that `tandem rl` sets once for trainer and orchestrator (they resume together)."""

WEIGHT_TRANSPORT_KEYS = ("weight_transport",)
"""The trainer sends and the orchestrator triggers loads over the same weight transport."""


class DeploymentConfig(Section):
    """Where each process runs."""

    type: Literal["cpu", "gpu"] = "cpu"
    """`cpu`: everything on the CPU; `gpu`: inference and trainer on the CUDA devices below."""

    num_trainer_processes: int = 1
    """Trainer ranks on CPU (gloo, under torchrun when more than one)."""

    num_inference_servers: int = Field(1, ge=1)
    """Inference servers (data parallel): `tandem rl` starts, health-checks and stops each, and the
    orchestrator spreads rollouts over all of them. Each holds `inference.vllm.tensor_parallel_size`
    GPUs (1 with the tandem backend); on CPU each is one process on its own port."""

    inference_devices: list[int] = [0]
    """CUDA devices of the inference servers (`gpu` only): `num_inference_servers` x tensor parallel
    size of them, server i taking the i-th consecutive slice."""

    trainer_devices: list[int] = [1]
    """CUDA devices of the trainer, one rank each (`gpu` only). Listing the inference device
    here too shares that GPU; the engine then takes `shared_gpu_memory_fraction` of it."""

    shared_gpu_memory_fraction: float = 0.4
    """Share of a GPU the engine may use when it shares the GPU with the trainer."""

    @property
    def num_trainer_ranks(self) -> int:
        return len(self.trainer_devices) if self.type == "gpu" else self.num_trainer_processes


class WarmupConfig(Section):
    """How `tandem rl` makes the starting model when `model.name` does not exist yet."""

    sft: Path | None = None
    """SFT config to run first (`tandem sft @ <this>`); it must write the folder `model.name`."""

    base_preset: str | None = None
    """If the SFT config's base model folder is missing, create it with `tandem model init`."""

    data_env: str | None = None
    """If the SFT config's `data.path` is missing, generate it from this environment's SFT examples."""

    data_args: dict = {}
    """Keyword arguments of the environment's `sft_examples` (seed, word counts...): keep them equal
    to the RL environment's args, so SFT examples come from its train split, never its eval split."""

    num_examples: int = 2000
    """Number of generated SFT examples (train split)."""

    num_eval_examples: int = 100
    """Number of generated SFT examples written next to it for eval loss (`eval.jsonl`)."""


class RLCheckpointConfig(Section):
    enabled: bool = False
    """Checkpoint trainer and orchestrator (needed for `--resume`)."""

    interval: int = 10
    """Steps between checkpoints."""


class RLConfig(ProcessConfig):
    trainer: TrainerConfig = TrainerConfig()
    """The RL trainer."""

    orchestrator: OrchestratorConfig = OrchestratorConfig()
    """The orchestrator."""

    inference: InferenceConfig = InferenceConfig()
    """The inference server."""

    deployment: DeploymentConfig = DeploymentConfig()
    """Devices and ranks of the processes."""

    warmup: WarmupConfig = WarmupConfig()
    """SFT warm-up run before RL when the starting model does not exist."""

    ckpt: RLCheckpointConfig = RLCheckpointConfig()
    """Checkpoints of trainer and orchestrator, taken at the same steps."""

    resume: bool = False
    """Continue the run in `output_dir` from its newest complete checkpoints."""

    clean: bool = False
    """Delete the results of an earlier run in `output_dir` before starting."""

    weight_transport: WeightTransportConfig = FilesystemWeightTransport()
    """How each new policy reaches the inference servers: `filesystem` (folders) or `broadcast`
    (a torch.distributed group from trainer rank 0); set here once for trainer and orchestrator."""

    health_timeout_s: float = 300.0
    """How long to wait for the inference server's `/health` before giving up."""

    @model_validator(mode="after")
    def _propagate_shared(self) -> "RLConfig":
        if self.resume and self.clean:
            raise ValueError("`resume` and `clean` exclude each other: choose one")
        for name in ("trainer", "orchestrator", "inference"):
            propagate_shared(self, getattr(self, name), name, SHARED_KEYS)
        for name in ("trainer", "orchestrator"):
            propagate_shared(self, getattr(self, name), name, CKPT_KEYS + WEIGHT_TRANSPORT_KEYS)
        return self


def propagate_shared(root: ProcessConfig, sub: ProcessConfig, sub_name: str, keys: tuple[str, ...]) -> None:
    """Copy every key of `keys` from `root` into `sub`; raise if `sub` set one to another value."""
    for key in keys:
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
