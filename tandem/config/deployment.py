"""Where the processes of an RL run go: one machine or several (`[deployment.cluster]`), launched locally, by
Slurm (`[deployment.slurm]`) or on Kubernetes (`[deployment.k8s]`), with which devices each process gets."""

from __future__ import annotations

import datetime
import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from tandem.config.base import Section


class ClusterConfig(Section):
    """The nodes of a run over several machines (the defaults: one machine). `tandem rl` runs once on every
    node, with that node's `node_rank`; each launcher starts the processes of its node. Placement: the trainer
    on nodes `0 .. num_trainer_nodes-1`, `deployment.num_inference_servers` inference servers on each of the
    last `num_inference_nodes` nodes, the orchestrator on the last node (the ranges may overlap). The run folder
    must be on a file system every node shares: processes exchange rollouts and weights there, and the launchers
    their heartbeats.

    Disaggregated (`deployment.num_prefill_servers` and `num_decode_servers`), `num_prefill_nodes` places the pools,
    and this is the one place of the rule (`tandem.config.placement` applies it). 0: every inference node runs both
    pools, and its decode servers hand prompts to its own prefill servers, so the KV cache never leaves a host. k > 0:
    the first k inference nodes run `num_prefill_servers` prefill servers each and the others `num_decode_servers`
    decode servers each (so the orchestrator's node holds decode servers); every decode server knows every prefill
    server, and each prefill server gets its weight updates from one decode server. Either way a node's servers take
    ports `inference.server.port` + 0, 1, ... in that order, prefill servers first."""

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

    num_prefill_nodes: int = Field(0, ge=0)
    """Disaggregated: inference nodes (the first ones) that run only prefill servers, the other inference nodes
    running only decode servers; 0: every inference node runs both pools, its decode servers handing prompts to its
    own prefill servers. Must leave at least one inference node for the decode servers."""

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
        if self.num_prefill_nodes and self.num_prefill_nodes >= self.num_inference_nodes:
            raise ValueError(f"`num_prefill_nodes` = {self.num_prefill_nodes} leaves no node of `num_inference_nodes` = "
                             f"{self.num_inference_nodes} for the decode servers: lower it or add inference nodes")
        if self.node_rank >= n:
            raise ValueError(f"`node_rank` = {self.node_rank} must be below `num_nodes` = {n}")
        if self.hosts and len(self.hosts) != n:
            raise ValueError(f"`hosts` lists {len(self.hosts)} address(es) but `num_nodes` = {n}")
        return self

    @property
    def first_inference_node(self) -> int:
        return self.num_nodes - self.num_inference_nodes

    def roles(self, node: int) -> list[str]:
        """The processes that node `node` runs, in start order."""
        roles = ["inference"] if node >= self.first_inference_node else []
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

    num_prefill_servers: int = Field(0, ge=0)
    """Prefill/decode disaggregation (with `num_decode_servers`; 0 and 0, the default: colocated servers, as many as
    `num_inference_servers`): servers that only compute prompts and hand their KV cache to a decode server, this
    many on each node that runs the pool (`cluster.num_prefill_nodes`). They start first; the orchestrator never
    talks to them (`docs/inference.md`)."""

    num_decode_servers: int = Field(0, ge=0)
    """Prefill/decode disaggregation: servers the orchestrator talks to, this many on each node that runs the pool;
    each hands prompts of at least `inference.disaggregation.min_remote_prefill_tokens` new tokens to a prefill
    server and decodes them."""

    disaggregated_memory_fraction: float | None = Field(None, gt=0.0, le=1.0)
    """`gpu`, disaggregated: let prefill and decode servers share GPUs, server i on
    `inference_devices[i % len(inference_devices)]`, each engine taking this fraction of its GPU (servers start one
    after the other, and each engine's `memory_fraction` counts what the GPU holds when it starts, so the k-th
    server on a GPU gets k times this fraction). Unset, every server needs a GPU of its own."""

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

    @model_validator(mode="after")
    def _check_pools(self) -> "DeploymentConfig":
        prefill, decode = self.num_prefill_servers, self.num_decode_servers
        if not (prefill or decode):
            if self.cluster.num_prefill_nodes:
                raise ValueError(f"`cluster.num_prefill_nodes` = {self.cluster.num_prefill_nodes} but "
                                 "`num_prefill_servers` and `num_decode_servers` are 0 (colocated servers): remove it or "
                                 "set both counts")
            if self.disaggregated_memory_fraction is not None:
                raise ValueError("`disaggregated_memory_fraction` is set but `num_prefill_servers` and "
                                 "`num_decode_servers` are 0 (colocated servers): remove it or set both counts")
            return self
        if not (prefill and decode):
            zero, other = ("num_prefill_servers", "num_decode_servers") if not prefill else ("num_decode_servers",
                                                                                               "num_prefill_servers")
            raise ValueError(f"`{zero}` = 0 leaves a pool empty while `{other}` = {getattr(self, other)}: a "
                             "disaggregated deployment needs at least one server in each pool (set both, or neither "
                             "for colocated servers)")
        if self.num_inference_servers != 1:
            raise ValueError(f"`num_inference_servers` = {self.num_inference_servers} counts colocated servers; with "
                             "`num_prefill_servers` and `num_decode_servers` set, leave it unset")
        busiest = self.num_servers_per_node
        if (self.type == "gpu" and busiest > len(self.inference_devices)
                and self.disaggregated_memory_fraction is None):
            counts = ("`num_prefill_servers` + `num_decode_servers`" if not self.cluster.num_prefill_nodes else
                      "the busiest node's `num_prefill_servers` or `num_decode_servers`")
            raise ValueError(f"{counts} = {busiest} servers but "
                             f"`inference_devices` = {self.inference_devices} lists {len(self.inference_devices)} "
                             "GPU(s): list one per server, or set `disaggregated_memory_fraction` to let servers share "
                             "a GPU")
        if self.type == "gpu" and self.disaggregated_memory_fraction is not None and self.inference_devices:
            sharing = -(-busiest // len(self.inference_devices))  # servers on the busiest GPU
            if sharing * self.disaggregated_memory_fraction > 1.0:
                raise ValueError(f"`disaggregated_memory_fraction` = {self.disaggregated_memory_fraction} x {sharing} "
                                 f"servers on one of `inference_devices` = {self.inference_devices} is more than the "
                                 "whole GPU: lower it to at most 1 / the servers a GPU holds")
        return self

    @property
    def is_disaggregated(self) -> bool:
        return self.num_prefill_servers > 0

    def server_roles(self, node: int) -> list[str]:
        """The role of each inference server of node `node`, in port order (the placement `ClusterConfig` states)."""
        cluster = self.cluster
        if node < cluster.first_inference_node:
            return []
        if not self.is_disaggregated:
            return ["colocated"] * self.num_inference_servers
        prefill, decode = ["prefill"] * self.num_prefill_servers, ["decode"] * self.num_decode_servers
        if not cluster.num_prefill_nodes:
            return prefill + decode
        return prefill if node < cluster.first_inference_node + cluster.num_prefill_nodes else decode

    @property
    def num_servers_per_node(self) -> int:
        """Inference servers of the busiest inference node: every inference node has that many ports (and on `gpu`
        device slices) ready, and its own servers take the first ones."""
        return max(len(self.server_roles(node)) for node in range(self.cluster.num_nodes))

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
