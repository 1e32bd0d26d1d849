"""The RL config as the user writes it: the three process configs plus what they share.

This module is the schema only. `tandem/config/resolve.py` turns it into what each process gets
(shared keys copied in, derived values decided, each process config validated once).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from tandem.config.base import CheckpointConfig, ProcessConfig, Section
from tandem.config.inference import InferenceConfig
from tandem.config.orchestrator import OrchestratorConfig
from tandem.config.trainer import TrainerConfig
from tandem.config.weight_transport import FilesystemWeightTransport, WeightTransportConfig


class DeploymentConfig(Section):
    """Where each process runs."""

    type: Literal["cpu", "gpu"] = "cpu"
    """`cpu`: everything on the CPU; `gpu`: inference and trainer on the CUDA devices below."""

    num_trainer_processes: int = Field(1, ge=1)
    """Trainer ranks on CPU (gloo, under torchrun when more than one)."""

    num_inference_servers: int = Field(1, ge=1)
    """Inference servers (data parallel): `tandem rl` starts, health-checks and stops each, and the
    orchestrator spreads rollouts over all of them. Each holds `inference.vllm.tensor_parallel_size`
    GPUs (1 with the tandem backend); on CPU each is one process on its own port."""

    inference_devices: list[int] = [0]
    """CUDA devices of the inference servers (`gpu` only), as indices of the devices this machine shows:
    `num_inference_servers` x the devices of one server (`inference.vllm.tensor_parallel_size` with vLLM,
    1 with tandem's engine), server i taking the i-th consecutive slice."""

    trainer_devices: list[int] = [1]
    """CUDA devices of the trainer, one rank each (`gpu` only). Listing the inference device here too
    shares that GPU (on a one-GPU machine: `[0]`); the engine then takes `shared_gpu_memory_fraction` of it."""

    shared_gpu_memory_fraction: float = Field(0.4, gt=0.0, le=1.0)
    """Share of a GPU the engine may use when it shares the GPU with the trainer."""

    inference_ports: list[int] = []
    """Port of each inference server; `tandem rl` decides it (`inference.server.port` + i, or a free
    port each when that is 0): leave it unset."""

    inference_device_slices: list[list[int]] = []
    """CUDA devices of each inference server (`gpu` only); `tandem rl` decides it from
    `inference_devices`: leave it unset."""

    @model_validator(mode="after")
    def _check_devices(self) -> "DeploymentConfig":
        for name in ("inference_devices", "trainer_devices"):
            devices = getattr(self, name)
            if not devices or min(devices) < 0 or len(set(devices)) != len(devices):
                raise ValueError(f"`deployment.{name}` = {devices} must list distinct CUDA device indices >= 0")
        return self

    @property
    def num_trainer_ranks(self) -> int:
        return len(self.trainer_devices) if self.type == "gpu" else self.num_trainer_processes

    @property
    def shares_a_gpu(self) -> bool:
        return self.type == "gpu" and bool(set(self.inference_devices) & set(self.trainer_devices))


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


class RLConfig(ProcessConfig):
    """Root config of `tandem rl`. Its shared keys and derived values reach the process configs
    through `tandem.config.resolve.resolve`, never by validation alone."""

    trainer: TrainerConfig = TrainerConfig()
    """The RL trainer."""

    orchestrator: OrchestratorConfig = OrchestratorConfig()
    """The orchestrator."""

    inference: InferenceConfig = InferenceConfig()
    """The inference servers: each gets this config, with its own port (`deployment.inference_ports`)."""

    deployment: DeploymentConfig = DeploymentConfig()
    """Devices and ranks of the processes."""

    warmup: WarmupConfig = WarmupConfig()
    """SFT warm-up run before RL when the starting model does not exist."""

    ckpt: CheckpointConfig = CheckpointConfig()
    """Checkpoints of trainer and orchestrator, taken at the same steps (needed for `resume`)."""

    resume: bool = False
    """Continue the run in `output_dir` from its newest complete checkpoints."""

    clean: bool = False
    """Delete the results of an earlier run in `output_dir` before starting."""

    weight_transport: WeightTransportConfig = FilesystemWeightTransport()
    """How each new policy reaches the inference servers: `filesystem` (folders) or `broadcast`
    (a torch.distributed group from trainer rank 0); set here once for trainer and orchestrator."""

    @model_validator(mode="after")
    def _check_resume_or_clean(self) -> "RLConfig":
        if self.resume and self.clean:
            raise ValueError("`resume` and `clean` exclude each other: choose one")
        return self
