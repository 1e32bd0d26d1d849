"""The RL config as the user writes it: the three process configs plus what they share.

This module is the schema only. `tandem/config/resolve.py` turns it into what each process gets
(shared keys copied in, derived values decided, each process config validated once).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from tandem.config.base import CheckpointConfig, ProcessConfig, Section
from tandem.config.deployment import DeploymentConfig
from tandem.config.inference import InferenceConfig
from tandem.config.orchestrator import OrchestratorConfig, ProbeConfig
from tandem.config.trainer import TrainerConfig
from tandem.config.weight_transport import FilesystemWeightTransport, WeightTransportConfig


class WarmupConfig(Section):
    """How `tandem rl` makes the starting model when `model.name` does not exist yet."""

    sft: Path | None = None
    """SFT config to run first (`tandem sft @ <this>`); it must write the folder `model.name`."""

    base_preset: str | None = None
    """If the SFT config's base model folder is missing, create it with `tandem model init`."""

    data_env: str | None = None
    """If the SFT config's `data.path` is missing, generate it from this environment's SFT examples."""

    data_args: dict = {}
    """Keyword arguments of the environment's `sft_examples`. Those it shares with the environment (seed,
    word counts...) must equal the RL environment's args, so SFT examples come from its train split, never
    its eval split; others shape the demonstrations (e.g. reverse_text's `misclosed_fraction`)."""

    num_examples: int = 2000
    """Number of generated SFT examples (train split)."""

    num_eval_examples: int = 100
    """Number of generated SFT examples written next to it for eval loss (`eval.jsonl`)."""


class PreflightConfig(ProbeConfig):
    """Checks `tandem rl` runs before step 1, once the inference server is up (`tandem.launch.preflight`); the
    probe's keys are the orchestrator's (`orchestrator.preflight`), which the shared keys fill from these."""

    enabled: bool = True
    """Run the preflight: a probe batch through server and trainer, a chat-template prefix check, a memory
    plan and an async-overlap estimate, saved as `preflight/report.txt` and `.json` in the run folder."""

    max_mismatch_kl: float = Field(1e-3, gt=0)
    """Stop the run when the mismatch KL between trainer and server on the probe batch (k3, per token) is
    above this: trainer and server then disagree on the policy, and importance ratios would be noise. A server
    that rounds to FP8 answers to `max_mismatch_kl_fp8` instead."""

    max_mismatch_kl_fp8: float = Field(1e-2, gt=0)
    """The limit in place of `max_mismatch_kl` when the server rounds to FP8 (`inference.engine.quantization` or
    `inference.engine.kv_cache_dtype` = "fp8") against a trainer that does not. e4m3 keeps 3 bits of mantissa where
    bf16 keeps 7, so FP8 rollouts sit further from the trainer's logprobs by design, and the loss's importance
    ratio corrects for it (`docs/trainer.md`, "FP8 rollouts"): 10x `max_mismatch_kl` leaves that room while a
    k3 of 1e-2 still means a log-ratio of about sqrt(2 x 1e-2) = 0.14 root mean square, ratios near 1 that a
    truncated importance weight handles. Lower it to a few times what your FP8 runs' probe shows."""


class WandbConfig(Section):
    """Weights & Biases logging of the run: the launcher mirrors the run folder (`metrics.jsonl` of every
    process, rollouts of `samples.jsonl`) into one W&B run (`tandem.monitor.wandb_run`)."""

    project: str | None = None
    """W&B project to log to; unset: no W&B logging. Needs the `wandb` package (`pip install 'tandem-rl[wandb]'`)."""

    entity: str | None = None
    """W&B team or user; unset: the logged-in user's default."""

    name: str | None = None
    """W&B run name; unset: `run.name`."""

    group: str | None = None
    """W&B group, to show several runs (seeds, ablations) together."""

    tags: list[str] = []
    """W&B tags of the run."""

    mode: Literal["online", "offline"] = "online"
    """`offline` writes the W&B run under `<run folder>/wandb` only (upload it later with `wandb sync`)."""

    samples_interval: int = Field(10, ge=0)
    """Log a table of the rollouts every this many steps (and of every eval); 0: no tables."""

    max_samples: int = Field(32, ge=1)
    """Most rollouts in one table (the first ones of the step's `samples.jsonl`)."""

    @field_validator("project")
    @classmethod
    def _check_installed(cls, project: str | None) -> str | None:
        if project is not None and importlib.util.find_spec("wandb") is None:
            raise ValueError("W&B logging needs the `wandb` package, which is not installed: pip install 'tandem-rl[wandb]'")
        return project


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

    hang_timeout_s: float = Field(120.0, gt=0)
    """A started inference server that answers no `GET /health` for this long (stopped, deadlocked, not
    dead) ends the run, named: its clients would otherwise wait out their request timeouts."""

    preflight: PreflightConfig = PreflightConfig()
    """Checks before step 1."""

    preflight_only: bool = False
    """Run the preflight (`preflight`) and stop: no orchestrator, no training."""

    wandb: WandbConfig = WandbConfig()
    """Weights & Biases logging (off unless `wandb.project` is set)."""

    @model_validator(mode="after")
    def _check_resume_or_clean(self) -> "RLConfig":
        if self.resume and self.clean:
            raise ValueError("`resume` and `clean` exclude each other: choose one")
        return self

    @model_validator(mode="after")
    def _check_context_parallel(self) -> "RLConfig":
        """A `cp` group splits rows among trainer ranks: its size must divide them (found before any process starts)."""
        ranks, cp = self.deployment.num_trainer_ranks, self.trainer.parallel.cp
        if ranks % cp:
            source = "len(deployment.trainer_devices)" if self.deployment.type == "gpu" else "deployment.num_trainer_processes"
            raise ValueError(f"`trainer.parallel.cp` = {cp} must divide the trainer's ranks, `{source}` = {ranks}")
        return self

    @model_validator(mode="after")
    def _check_preflight_only(self) -> "RLConfig":
        if self.preflight_only and not self.preflight.enabled:
            raise ValueError("`preflight_only` runs the preflight, which `preflight.enabled` = false turns off: choose one")
        return self
