"""The RL config as the user writes it: the three process configs plus what they share.

This module is the schema only. `tandem/config/resolve.py` turns it into what each process gets
(shared keys copied in, derived values decided, each process config validated once).
"""

from __future__ import annotations

import datetime
import importlib.util
import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from tandem.config.base import CheckpointConfig, ProcessConfig, Section
from tandem.config.inference import InferenceConfig
from tandem.config.orchestrator import OrchestratorConfig
from tandem.config.trainer import TrainerConfig
from tandem.config.weight_transport import FilesystemWeightTransport, WeightTransportConfig


class ClusterConfig(Section):
    """The nodes of a run over several machines (the defaults: one machine). `tandem rl` runs once on every
    node, with that node's `node_rank`; each launcher starts the processes of its node. Placement: the trainer
    on nodes `0 .. num_trainer_nodes-1`, `deployment.num_inference_servers` inference servers on each of the
    last `num_inference_nodes` nodes, the orchestrator on the last node (the ranges may overlap). The run folder
    must be on a file system every node shares: processes exchange rollouts and weights there, and the launchers
    their heartbeats."""

    num_nodes: int = Field(1, ge=1)
    """Machines of the run."""

    hosts: list[str] = []
    """Address of each node, in node-rank order (`len` = `num_nodes`); the trainer's rendezvous is on
    `hosts[0]`, the orchestrator reaches the inference nodes by theirs. Under `--slurm` the job script fills it
    from the allocation at start; under `--k8s` it is the pods' DNS names."""

    node_rank: int = Field(0, ge=0)
    """Which node of `hosts` this launcher is."""

    num_trainer_nodes: int = Field(1, ge=1)
    """Nodes running trainer ranks (`deployment.trainer_devices` on `gpu`, `num_trainer_processes` on `cpu`,
    on each), joined by torchrun's c10d rendezvous."""

    num_inference_nodes: int = Field(1, ge=1)
    """Nodes running inference servers (`deployment.num_inference_servers` each)."""

    rendezvous_port: int = Field(29400, ge=1, le=65535)
    """TCP port of the trainer's c10d rendezvous on `hosts[0]`."""

    rendezvous_id: str = "tandem"
    """Names one attempt of the run, for torchrun and for the launchers' heartbeats
    (`nodes/<rendezvous_id>/` in the run folder): give a restarted run a new one (Slurm: the job id)."""

    join_timeout_s: float = Field(300.0, gt=0)
    """Every launcher waits this long for all nodes to start (and torchrun for its rendezvous); past it the
    run fails, naming the nodes that did not come."""

    peer_timeout_s: float = Field(30.0, gt=0)
    """A node whose heartbeat stops for this long is lost: every other node stops its processes, naming it."""

    @model_validator(mode="after")
    def _check_nodes(self) -> "ClusterConfig":
        n = self.num_nodes
        for name in ("num_trainer_nodes", "num_inference_nodes"):
            if getattr(self, name) > n:
                raise ValueError(f"`{name}` = {getattr(self, name)} is more than `num_nodes` = {n}")
        if self.num_trainer_nodes + self.num_inference_nodes < n:
            raise ValueError(f"nodes {self.num_trainer_nodes} .. {n - self.num_inference_nodes - 1} would run nothing: "
                             f"`num_trainer_nodes` + `num_inference_nodes` must be at least `num_nodes` = {n}")
        if self.node_rank >= n:
            raise ValueError(f"`node_rank` = {self.node_rank} must be below `num_nodes` = {n}")
        if self.hosts and len(self.hosts) != n:
            raise ValueError(f"`hosts` lists {len(self.hosts)} address(es) but `num_nodes` = {n}")
        return self

    def roles(self, node: int) -> list[str]:
        """The processes that node `node` runs, in start order."""
        roles = ["inference"] if node >= self.num_nodes - self.num_inference_nodes else []
        roles += ["orchestrator"] if node == self.num_nodes - 1 else []
        return roles + (["trainer"] if node < self.num_trainer_nodes else [])


class SlurmConfig(Section):
    """The sbatch job `tandem rl --slurm` renders: one node per `deployment.cluster` node."""

    partition: str | None = None
    """`#SBATCH --partition`; unset: the cluster's default."""

    account: str | None = None
    """`#SBATCH --account`; unset: the user's default."""

    time_limit: str = "04:00:00"
    """`#SBATCH --time`: Slurm ends the job (and frees its nodes) after this, whatever happens."""

    setup: list[str] = []
    """Shell lines run on each node before `tandem` (load modules, activate the virtual environment)."""

    @field_validator("time_limit", mode="before")
    @classmethod
    def _time_as_text(cls, value: object) -> object:
        # `--deployment.slurm.time-limit 01:30:00` reads as a TOML time; Slurm wants the text.
        return value.isoformat() if isinstance(value, datetime.time) else value


class K8sConfig(Section):
    """The Kubernetes manifests `tandem rl --k8s` renders."""

    namespace: str = "default"
    """Namespace of every object."""

    image: str = "tandem:latest"
    """Container image with tandem installed (the same for every process)."""

    storage: str = "100Gi"
    """Size of the shared run volume (a ReadWriteMany claim, mounted in every pod at the run folder's path,
    under the working directory `/workspace` when `output_dir` is relative)."""

    storage_class: str | None = None
    """Storage class of the run volume (one that offers ReadWriteMany, e.g. NFS or CephFS); unset: the default."""

    @staticmethod
    def object_name(run_name: str, role: str) -> str:
        """The name of a role's objects: the run name made a DNS label, then the role."""
        label = re.sub(r"[^a-z0-9-]+", "-", run_name.lower())[:40].strip("-") or "tandem"
        return f"{label}-{role}"

    @classmethod
    def pod_host(cls, run_name: str, role: str, index: int) -> str:
        """DNS name of pod `index` of a role, through the role's headless Service."""
        name = cls.object_name(run_name, role)
        return f"{name}-{index}.{name}"


class DeploymentConfig(Section):
    """Where each process runs."""

    launcher: Literal["local", "slurm", "k8s"] = "local"
    """`local`: `tandem rl` starts this node's processes; `slurm`: render the sbatch script and submit it
    (`--slurm`); `k8s`: render Kubernetes manifests (`--k8s`)."""

    cluster: ClusterConfig = ClusterConfig()
    """Nodes of the run."""

    slurm: SlurmConfig = SlurmConfig()
    """The Slurm job (`launcher = "slurm"`)."""

    k8s: K8sConfig = K8sConfig()
    """The Kubernetes objects (`launcher = "k8s"`)."""

    type: Literal["cpu", "gpu"] = "cpu"
    """`cpu`: everything on the CPU; `gpu`: inference and trainer on the CUDA devices below."""

    num_trainer_processes: int = Field(1, ge=1)
    """Trainer ranks on CPU (gloo, under torchrun when more than one)."""

    num_inference_servers: int = Field(1, ge=1)
    """Inference servers (data parallel) on each inference node: `tandem rl` starts, health-checks and stops each, and the
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
    def ranks_per_node(self) -> int:
        """Trainer ranks on each trainer node."""
        return len(self.trainer_devices) if self.type == "gpu" else self.num_trainer_processes

    @property
    def num_trainer_ranks(self) -> int:
        """The trainer's world size, over all its nodes."""
        return self.ranks_per_node * self.cluster.num_trainer_nodes

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
    """Keyword arguments of the environment's `sft_examples`. Those it shares with the environment (seed,
    word counts...) must equal the RL environment's args, so SFT examples come from its train split, never
    its eval split; others shape the demonstrations (e.g. reverse_text's `misclosed_fraction`)."""

    num_examples: int = 2000
    """Number of generated SFT examples (train split)."""

    num_eval_examples: int = 100
    """Number of generated SFT examples written next to it for eval loss (`eval.jsonl`)."""


class PreflightConfig(Section):
    """Checks `tandem rl` runs before step 1, once the inference server is up (`tandem.launch.preflight`)."""

    enabled: bool = True
    """Run the preflight: a probe batch through server and trainer, a chat-template prefix check, a memory
    plan and an async-overlap estimate, saved as `preflight/report.txt` and `.json` in the run folder."""

    max_mismatch_kl: float = Field(1e-3, gt=0)
    """Stop the run when the mismatch KL between trainer and server on the probe batch (k3, per token) is
    above this: trainer and server then disagree on the policy, and importance ratios would be noise."""

    num_conversations: int = Field(4, ge=1)
    """Probe conversations, each of two model turns (the second turn tests the chat-template prefix rule)."""

    max_tokens: int = Field(16, ge=1)
    """Most tokens of each probe turn."""


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
