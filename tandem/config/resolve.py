"""Resolution of `tandem rl`: what the user wrote -> the complete config of each process.

`resolve()` is one step whose only inputs are the user's input, the machine it is given (CUDA devices,
free ports) and the run folder (checkpoints to resume from), in this order:

1. the RL config's own keys (shared keys, `deployment`, `warmup`, `ckpt`, `resume`) are validated;
2. every key of `SHARED_KEYS` is written into the sections of the processes that share it;
3. the config is validated with the user's process sections, and every rule of `DERIVED_RULES`
   decides its values from that draft and the machine (a rule may also refuse the config);
4. the derived values are written in (a value decided for a shared key, such as `weight_transport.port`,
   also into the processes that share it) and the whole config, three process configs included, is
   validated once more: that result is what `--dry-run` prints and what the launcher runs
   (`process_configs`: one config per process, each inference server included).

A shared or derived value never overwrites one the user set: a different value is an error naming
both. A new shared key is one line in `SHARED_KEYS`; a new derived value is one function added to
`DERIVED_RULES` (its docstring is its documentation in `docs/configuration.md`).
"""

from __future__ import annotations

import copy
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

from tandem.config.base import ModelConfig, ProcessConfig
from tandem.config.deployment import DeploymentConfig
from tandem.config.inference import DisaggregationConfig, EngineConfig
from tandem.config.loader import ConfigError, RawConfig, parse_args, read_args, shown, validate
from tandem.config.placement import PlacedServer, place_servers, prefill_peers, updates_forwarded_by
from tandem.config.rl import RLConfig
from tandem.config.sft import SFTConfig
from tandem.models.hub import is_hub_name
from tandem.transport.paths import common_checkpoint_steps, complete_checkpoint_steps, final_weights_dir, weights_dir

PROCESSES = ("inference", "orchestrator", "trainer")
"""The sections of `RLConfig` that are process configs."""

SHARED_KEYS: dict[str, tuple[str, ...]] = {
    "model.name": PROCESSES,
    "model.load_format": PROCESSES,
    "run.name": PROCESSES,
    "run.exact": PROCESSES,  # one switch: engine and trainer compute alike or not at all
    "seq_len": PROCESSES,
    "max_steps": PROCESSES,
    "output_dir": PROCESSES,
    "seed": PROCESSES,
    "ckpt.enabled": ("orchestrator", "trainer"),  # both checkpoint the same steps, so they resume together
    "ckpt.interval": ("orchestrator", "trainer"),
    "weight_transport": ("orchestrator", "trainer"),  # the trainer sends what the orchestrator has the servers load
    "preflight.num_conversations": ("orchestrator",),  # the orchestrator's preflight process samples the probe
    "preflight.max_tokens": ("orchestrator",),
}
"""Dotted key of `RLConfig` -> the processes whose config gets its value."""


class Machine(Protocol):
    """What resolution needs to know about the machine the run starts on."""

    def num_cuda_devices(self) -> int:
        """CUDA devices this process can see (after `CUDA_VISIBLE_DEVICES`)."""

    def free_port(self) -> int:
        """A TCP port free on the loopback interface now, and not handed out before by this machine."""


class LocalMachine:
    """This machine. Torch is imported only when a GPU deployment asks for its devices."""

    def __init__(self) -> None:
        self._given: set[int] = set()

    def num_cuda_devices(self) -> int:
        import torch

        return torch.cuda.device_count()

    def free_port(self) -> int:
        # Each server and the broadcast group need their own port: the OS may hand back one just closed.
        port = free_port()
        while port in self._given:
            port = free_port()
        self._given.add(port)
        return port


def free_port() -> int:
    """A TCP port free on the loopback interface now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Derived:
    """One value a rule decides: dotted `key` of `RLConfig` gets `value` `because` (a phrase naming its cause)."""

    key: str
    value: Any
    because: str
    placeholder: Any = None
    """A user value that means "decide for me" (port 0); None: any user value other than `value` conflicts."""


Rule = Callable[[RLConfig, Machine], list[Derived]]


def nodes(config: RLConfig, machine: Machine) -> list[Derived]:
    """On several nodes (`deployment.cluster.num_nodes` > 1), `deployment.cluster.hosts` lists every node's
    address: as written, or under `--k8s` the pods' DNS names (`<run>-trainer-<i>.<run>-trainer`, then
    `<run>-inference-<j>.<run>-inference`), or under `--slurm` placeholders that the job script replaces with
    the allocation's hosts at start. `inference.server.host` is then `0.0.0.0` (every interface, so that the
    orchestrator's node reaches it), or this node's own host when every host is a loopback address (nodes
    simulated on one machine: `127.0.0.1`, `127.0.0.2`, ... keep their servers' ports apart). Under `--k8s` each
    role has its own pods, so `num_nodes` must be `num_trainer_nodes` + `num_inference_nodes`, and each inference
    pod runs one server (`deployment.num_inference_servers` = 1; disaggregated, `num_prefill_servers` =
    `num_decode_servers` = 1 and `deployment.cluster.num_prefill_nodes` > 0: the prefill pods
    `<run>-prefill-<j>.<run>-prefill` come before the decode pods, which are the `<run>-inference` ones)."""
    cluster = config.deployment.cluster
    _check_k8s_pools(config)
    if config.deployment.launcher == "k8s" and cluster.num_trainer_nodes + cluster.num_inference_nodes != cluster.num_nodes:
        raise ConfigError("`deployment.launcher` = 'k8s' runs each node's role in its own pods: set `deployment.cluster.num_nodes` = "
                          f"`num_trainer_nodes` + `num_inference_nodes` = {cluster.num_trainer_nodes + cluster.num_inference_nodes}")
    if config.deployment.launcher == "k8s" and config.deployment.num_inference_servers > 1:
        raise ConfigError("`deployment.launcher` = 'k8s' runs one inference server per pod: set "
                          "`deployment.num_inference_servers` = 1 (and more `deployment.cluster.num_inference_nodes`)")
    if cluster.num_nodes == 1:
        return []
    hosts = cluster_hosts(config)
    bind = hosts[cluster.node_rank] if all(_is_loopback(h) for h in hosts) else "0.0.0.0"
    return [Derived("deployment.cluster.hosts", hosts, f"`deployment.launcher` = {config.deployment.launcher!r}", placeholder=[]),
            Derived("inference.server.host", bind, "`deployment.cluster.hosts` (servers answer other nodes)")]


def _check_k8s_pools(config: RLConfig) -> None:
    """Under `--k8s` a pod runs one server: disaggregated, the pools are pods of their own (see the rule `nodes`)."""
    deployment = config.deployment
    if deployment.launcher != "k8s" or not deployment.is_disaggregated:
        return
    if deployment.cluster.num_prefill_nodes == 0:
        raise ConfigError("`deployment.launcher` = 'k8s' with `deployment.num_prefill_servers` runs each pool in pods of "
                          "its own: set `deployment.cluster.num_prefill_nodes` (the prefill pods, at least 1) and leave "
                          "the other inference nodes to the decode servers")
    for name in ("num_prefill_servers", "num_decode_servers"):
        if getattr(deployment, name) != 1:
            raise ConfigError(f"`deployment.launcher` = 'k8s' runs one inference server per pod: set "
                              f"`deployment.{name}` = 1 (and more pods through `deployment.cluster.num_inference_nodes` "
                              "and `num_prefill_nodes`)")


def cluster_hosts(config: RLConfig) -> list[str]:
    """The address of each node (see the rule `nodes`); one node is this machine."""
    deployment, cluster = config.deployment, config.deployment.cluster
    if cluster.hosts or cluster.num_nodes == 1:
        return list(cluster.hosts) or ["127.0.0.1"]
    if deployment.launcher == "slurm":
        return [f"slurm-node-{i}" for i in range(cluster.num_nodes)]
    if deployment.launcher == "k8s":
        k8s = deployment.k8s
        num_prefill = cluster.num_prefill_nodes if deployment.is_disaggregated else 0
        return ([k8s.pod_host(config.run.name, "trainer", i) for i in range(cluster.num_trainer_nodes)]
                + [k8s.pod_host(config.run.name, "prefill", i) for i in range(num_prefill)]
                + [k8s.pod_host(config.run.name, "inference", i) for i in range(cluster.num_inference_nodes - num_prefill)])
    raise ConfigError(f"`deployment.cluster.num_nodes` = {cluster.num_nodes} needs `deployment.cluster.hosts`: the address of each "
                      "node in node-rank order (or `--slurm` / `--k8s`, which decide them)")


def _is_loopback(host: str) -> bool:
    return host == "localhost" or host.startswith("127.")


def trainer_ranks(config: RLConfig, machine: Machine) -> list[Derived]:
    """`orchestrator.num_trainer_ranks` (one batch file per rank) is the trainer's world size:
    `len(deployment.trainer_devices)` on `gpu`, `deployment.num_trainer_processes` on `cpu`, on each of
    `deployment.cluster.num_trainer_nodes` nodes."""
    cause = "deployment.trainer_devices" if config.deployment.type == "gpu" else "deployment.num_trainer_processes"
    nodes = " and `deployment.cluster.num_trainer_nodes`" if config.deployment.cluster.num_trainer_nodes > 1 else ""
    return [Derived("orchestrator.num_trainer_ranks", config.deployment.num_trainer_ranks, f"`{cause}`{nodes}")]


def devices(config: RLConfig, machine: Machine) -> list[Derived]:
    """`deployment.type` sets `trainer.device` and `inference.engine.device` (`cpu` or `cuda`). On `gpu`,
    every index in `deployment.inference_devices` and `deployment.trainer_devices` must be a CUDA device
    this machine shows (under `--slurm` and `--k8s`, each node checks its own at start); when both lists name
    one GPU, `inference.engine.memory_fraction` is `deployment.shared_gpu_memory_fraction` (on a one-GPU
    machine, `trainer_devices = [0]` shares GPU 0)."""
    deployment = config.deployment
    device = "cuda" if deployment.type == "gpu" else "cpu"
    out = [Derived("trainer.device", device, f"`deployment.type` = {deployment.type!r}"),
           Derived("inference.engine.device", device, f"`deployment.type` = {deployment.type!r}")]
    if deployment.type == "cpu":
        return out
    visible = machine.num_cuda_devices() if deployment.launcher == "local" else float("inf")
    for name in ("inference_devices", "trainer_devices"):
        missing = [d for d in getattr(deployment, name) if d >= visible]
        if missing:
            share = "; to share GPU 0 with the inference server, set `deployment.trainer_devices = [0]`" if visible == 1 else ""
            raise ConfigError(f"`deployment.{name}` = {getattr(deployment, name)} names CUDA device(s) {missing}, but this "
                              f"machine shows {visible} CUDA device(s){share}")
    if deployment.shares_a_gpu:
        out.append(Derived("inference.engine.memory_fraction", deployment.shared_gpu_memory_fraction,
                           "`deployment.shared_gpu_memory_fraction` (the server shares a GPU with the trainer)"))
    return out


def inference_servers(config: RLConfig, machine: Machine) -> list[Derived]:
    """`deployment.inference_ports` holds a port for each of the `deployment.num_inference_servers` servers of an
    inference node: `inference.server.port` + i, or a free port each when `inference.server.port` is 0 (which
    then becomes the first server's). The orchestrator talks to them all: on one node,
    `orchestrator.client.base_urls` is `["http://<inference.server.host>:<port>", ...]`; on several nodes it has
    `http://<host>:<port>` for each inference node's host in `deployment.cluster.hosts` and each of its ports,
    and the port must be set (each node resolves the config itself: a port free on one is unknown to the
    others). `orchestrator.client.api_key` is `inference.server.api_key`. Disaggregated
    (`deployment.num_prefill_servers` and `num_decode_servers`), the orchestrator talks to the decode servers alone,
    wherever `deployment.cluster.num_prefill_nodes` puts them (`tandem.config.placement`); a node's prefill servers
    take its first ports, and every inference node has the ports of the busiest one ready."""
    server, cluster = config.inference.server, config.deployment.cluster
    num_servers = config.deployment.num_servers_per_node
    if cluster.num_nodes > 1 and server.port == 0:
        raise ConfigError("`inference.server.port` = 0 (a free port) cannot be agreed on by several nodes: "
                          f"set a fixed port for `deployment.cluster.num_nodes` = {cluster.num_nodes}")
    if server.port == 0:
        ports = [machine.free_port() for _ in range(num_servers)]
        out = [Derived("inference.server.port", ports[0], "a free port (`inference.server.port` = 0)", placeholder=0)]
        cause = "a free port for each of `deployment.num_inference_servers`"
    else:
        ports = [server.port + i for i in range(num_servers)]
        out = []
        cause = "`inference.server.port` + i for each of `deployment.num_inference_servers`"
    if max(ports) > 65535:
        raise ConfigError(f"`inference.server.port` = {server.port} leaves no port for {num_servers} servers: lower it")
    urls = [s.url for s in place_servers(config.deployment, _server_hosts(config), ports) if s.role != "prefill"]
    if cluster.num_nodes > 1:
        url_cause = "`deployment.cluster.hosts` of the inference nodes and `deployment.inference_ports`"
    else:
        url_cause = "`inference.server.host`, `inference.server.port` and `deployment.num_inference_servers`"
    if config.deployment.is_disaggregated:
        url_cause = url_cause.replace("`deployment.num_inference_servers`", "`deployment.num_decode_servers`") + \
            " (decode servers only)"
    return out + [
        Derived("deployment.inference_ports", ports, cause, placeholder=[]),
        Derived("orchestrator.client.base_urls", urls, url_cause),
        Derived("orchestrator.client.api_key", server.api_key, "`inference.server.api_key`"),
    ]


def inference_device_slices(config: RLConfig, machine: Machine) -> list[Derived]:
    """On `gpu`, a node's server i (prefill servers first) runs on `deployment.inference_device_slices[i]`: the i-th
    consecutive slice of `deployment.inference_devices`, of one server's devices each
    (`inference.vllm.tensor_parallel_size` with vLLM, 1 with tandem's engine), so the list must hold exactly
    `num_inference_servers` (disaggregated: the busiest node's servers) x that many. Empty on `cpu`.
    Disaggregated with `deployment.disaggregated_memory_fraction`, server i (prefill servers first) runs on
    `inference_devices[i % len(inference_devices)]` and `inference.engine.memory_fraction` is that fraction."""
    deployment = config.deployment
    if deployment.type != "gpu":
        return [Derived("deployment.inference_device_slices", [], "`deployment.type` = 'cpu'", placeholder=[])]
    per_server, num_servers = config.inference.num_ranks, deployment.num_servers_per_node
    devices = deployment.inference_devices
    fraction = deployment.disaggregated_memory_fraction
    if deployment.is_disaggregated and fraction is not None:
        slices = [[devices[i % len(devices)]] for i in range(num_servers)]
        return [Derived("deployment.inference_device_slices", slices, "`deployment.disaggregated_memory_fraction` "
                        "(servers share `deployment.inference_devices`)", placeholder=[]),
                Derived("inference.engine.memory_fraction", fraction, "`deployment.disaggregated_memory_fraction`")]
    if len(devices) != num_servers * per_server:
        counts = ("the busiest inference node's servers (`deployment.num_prefill_servers`, `num_decode_servers`)"
                  if deployment.is_disaggregated else "`deployment.num_inference_servers`")
        raise ConfigError(f"`deployment.inference_devices` = {devices} lists {len(devices)} CUDA device(s), but "
                          f"{counts} = {num_servers} server(s) of {per_server} device(s) need {num_servers * per_server}")
    slices = [devices[i * per_server:(i + 1) * per_server] for i in range(num_servers)]
    return [Derived("deployment.inference_device_slices", slices, "`deployment.inference_devices`", placeholder=[])]


def backend(config: RLConfig, machine: Machine) -> list[Derived]:
    """`orchestrator.client.backend` is `inference.backend` (the servers' token-in routes, folder reloads and
    policy versions differ: `orchestrator/server_dialect.py`). `inference.backend = "vllm"` needs
    `deployment.type = "gpu"` (vLLM runs on CUDA only) and no `orchestrator.sampling.return_routed_experts`
    (router replay reads tandem's engine); either weight transport works with it."""
    name = config.inference.backend
    if name == "vllm" and config.deployment.type != "gpu":
        raise ConfigError("`inference.backend` = 'vllm' runs on CUDA only: set `deployment.type` = 'gpu'")
    if name == "vllm" and config.orchestrator.sampling.return_routed_experts:
        raise ConfigError("`orchestrator.sampling.return_routed_experts` = true needs `inference.backend` = 'tandem': "
                          "router replay reads the experts tandem's engine reports with each token")
    return [Derived("orchestrator.client.backend", name, f"`inference.backend` = {name!r}")]


def weight_broadcast(config: RLConfig, machine: Machine) -> list[Derived]:
    """With `weight_transport.type = "broadcast"`: `weight_transport.num_inference_ranks` is the number of
    servers (`orchestrator.client.base_urls`: `deployment.num_inference_servers` on each inference node) x the ranks
    of one server (`inference.vllm.tensor_parallel_size` with vLLM, 1 with tandem's engine),
    `weight_transport.receiver` is `inference.backend`, `weight_transport.quantization` and `.fp8_experts` are
    `inference.engine.quantization` and `.fp8_experts` with tandem's engine ("none" with vLLM's, which quantizes on
    its own load), and
    `weight_transport.port = 0` becomes a free port. On
    several nodes the group meets at trainer rank 0, `weight_transport.host` is node 0's host, and the port must be
    set. On `gpu`, `deployment.trainer_devices` must be apart from `deployment.inference_devices` (NCCL runs one
    rank per GPU). Trainer and orchestrator get these values with the shared `weight_transport`."""
    transport, deployment = config.weight_transport, config.deployment
    if transport.type != "broadcast":
        return []
    if deployment.is_disaggregated:
        raise ConfigError("`weight_transport.type` = 'broadcast' with `deployment.num_prefill_servers`: prefill servers "
                          "load each policy from its folder, which a decode server passes on; use `weight_transport.type` "
                          "= 'filesystem' for a disaggregated deployment")
    cluster = deployment.cluster
    num_servers = deployment.num_inference_servers * (cluster.num_inference_nodes if cluster.num_nodes > 1 else 1)
    if cluster.num_nodes > 1 and transport.port == 0:
        raise ConfigError("`weight_transport.port` = 0 (a free port) cannot be agreed on by several nodes: "
                          f"set a fixed port for `deployment.cluster.num_nodes` = {cluster.num_nodes}")
    if config.trainer.lora.enabled and config.inference.backend == "vllm":
        raise ConfigError("`weight_transport.type` = 'broadcast' with `trainer.lora` and `inference.backend` = 'vllm': "
                          "vLLM's NCCL weight transfer loads full weights, not adapters; use the filesystem transport "
                          "(vLLM loads each adapter folder in place)")
    if deployment.shares_a_gpu:
        raise ConfigError(f"`weight_transport.type` = 'broadcast' needs `deployment.trainer_devices` = "
                          f"{deployment.trainer_devices} apart from `deployment.inference_devices` = "
                          f"{deployment.inference_devices} (NCCL runs one rank per GPU); use the filesystem transport "
                          "when they share a GPU")
    out = [Derived("weight_transport.num_inference_ranks", num_servers * config.inference.num_ranks,
                   "`deployment.num_inference_servers` (on each inference node) x the ranks of one server"),
           Derived("weight_transport.receiver", config.inference.backend, "`inference.backend`"),
           Derived("weight_transport.quantization", config.inference.engine.quantization, "`inference.engine.quantization`")
           if config.inference.backend == "tandem" else
           Derived("weight_transport.quantization", "none", "`inference.backend` = 'vllm' (vLLM quantizes on its own load)")]
    if config.inference.backend == "tandem":
        out.append(Derived("weight_transport.fp8_experts", config.inference.engine.fp8_experts,
                           "`inference.engine.fp8_experts`"))
    if cluster.num_nodes > 1:
        out.append(Derived("weight_transport.host", cluster_hosts(config)[0], "`deployment.cluster.hosts` (node 0 runs trainer "
                           "rank 0)", placeholder="127.0.0.1"))
    if transport.port == 0:
        out.append(Derived("weight_transport.port", machine.free_port(), "a free port (`weight_transport.port` = 0)",
                           placeholder=0))
    return out


def resume(config: RLConfig, machine: Machine) -> list[Derived]:
    """`resume` (`--resume`) sets `trainer.ckpt.resume` and `orchestrator.ckpt.resume`, and both
    `ckpt.resume_step` to the newest step that both checkpointed completely in the run folder, so they
    continue from the same step. A run folder where only one of them has checkpoints cannot resume."""
    processes = ("orchestrator", "trainer")
    out = [Derived(f"{name}.ckpt.resume", config.resume, "`resume`") for name in processes]
    if not config.resume:
        return out
    common = common_checkpoint_steps(config.run_dir)
    steps = {name: complete_checkpoint_steps(config.run_dir, name) for name in processes}
    if not common and any(steps.values()):
        raise ConfigError(f"`resume`: {config.run_dir} holds no step that both processes checkpointed (orchestrator: "
                          f"{steps['orchestrator']}, trainer: {steps['trainer']}); start over with `--clean`")
    return out + [Derived(f"{name}.ckpt.resume_step", max(common), "`resume` (the newest step both checkpointed)")
                  for name in processes if common]


def starting_model(config: RLConfig, machine: Machine) -> list[Derived]:
    """`model.name` is a model folder that exists, a hub name (`org/model`: no such path, one `/`, fetched at
    start), or what the SFT warm-up (`warmup.sft`, one node only) leaves: `weights/final` (or its target,
    `weights/step_<max_steps>`) under the SFT config's `output_dir`. Under `--slurm` and `--k8s`, each node checks
    at its start. It decides no value."""
    name = config.model.name
    if config.deployment.launcher != "local" or Path(name).expanduser().exists():
        return []
    sft = warmup_sft(config)
    if sft is None:
        if is_hub_name(name):
            return []
        raise ConfigError(f"`model.name` = {name!r} is no folder and no hub name (org/model): correct it, or set "
                          "`warmup.sft` to an SFT config that writes it")
    if config.deployment.cluster.num_nodes > 1:
        raise ConfigError(f"`model.name` = {name!r} does not exist, and a run of several nodes (`deployment.cluster."
                          "num_nodes`) does not run the warm-up (`warmup.sft`): run it first on one node (`tandem sft`, or "
                          "a one-node `tandem rl`)")
    final = final_weights_dir(sft.run_dir)
    if _normalized(name) not in (_normalized(final), _normalized(weights_dir(sft.run_dir, sft.max_steps))):
        raise ConfigError(f"`model.name` = {name!r} does not exist, and the warm-up `warmup.sft` = {str(config.warmup.sft)!r} "
                          f"does not write it: its result is {final}; correct `model.name`")
    return []


def warmup_sft(config: RLConfig) -> SFTConfig | None:
    """The SFT config `warmup.sft` names (its own file alone: `TANDEM_*` variables are the RL run's), or None."""
    if config.warmup.sft is None:
        return None
    try:
        return parse_args(SFTConfig, ["@", str(config.warmup.sft)], environ={})
    except ConfigError as err:
        raise ConfigError(f"`warmup.sft` = {str(config.warmup.sft)!r}: {err}") from None


def _normalized(path: str | Path) -> str:
    return os.path.normpath(os.path.abspath(Path(path).expanduser()))


def exact(config: RLConfig, machine: Machine) -> list[Derived]:
    """`run.exact = true` needs what can compute batch-invariantly, on both sides: the `tandem` backend (vLLM's
    kernels are not batch-invariant) and a model native to tandem (a `model_type` that falls back to transformers
    is refused when `model.name` is a local folder; otherwise each process refuses it at start). It decides no value."""
    if not config.run.exact:
        return []
    if config.trainer.parallel.cp > 1:
        raise ConfigError(f"`run.exact` = true cannot split rows over ranks: `trainer.parallel.cp` = "
                          f"{config.trainer.parallel.cp} attends in pieces whose reduction order the engine does not share")
    if config.inference.backend != "tandem":
        raise ConfigError(f"`run.exact` = true needs `inference.backend` = \"tandem\", not {config.inference.backend!r}: "
                          "vLLM's kernels depend on the batch, so its logprobs cannot equal the trainer's bit for bit")
    if config.inference.engine.quantization != "none":
        raise ConfigError(f"`run.exact` = true with `inference.engine.quantization` = "
                          f"{config.inference.engine.quantization!r}: rollouts from FP8 products cannot be bitwise equal "
                          "to a bf16 trainer's; set one of them off")
    if config.inference.engine.kv_cache_dtype != "auto":
        raise ConfigError(f"`run.exact` = true with `inference.engine.kv_cache_dtype` = "
                          f"{config.inference.engine.kv_cache_dtype!r}: attention over a cache rounded to FP8 (keys and "
                          "values, or latent entries) cannot be bitwise equal to a bf16 trainer's; set one of them off")
    hf_config = Path(config.model.name) / "config.json"
    if hf_config.is_file():
        from tandem.models.loading import is_native  # torch, only for exact runs

        model_type = json.loads(hf_config.read_text()).get("model_type")
        if not is_native({"model_type": model_type}):
            raise ConfigError(f"`run.exact` = true needs a model native to tandem; {hf_config} says model_type "
                              f"{model_type!r}, which falls back to transformers, whose kernels are not batch-invariant")
    return []


def lora(config: RLConfig, machine: Machine) -> list[Derived]:
    """`trainer.lora` reaches `inference.engine.lora` whole: the servers merge the adapters the trainer publishes
    with its rank, scale and targets. Left off, the engine's stays off too."""
    if not config.trainer.lora.enabled:
        return []
    because = "`trainer.lora` (the servers merge what the trainer's adapters adapt)"
    return [Derived(f"inference.engine.lora.{field}", value, because)
            for field, value in config.trainer.lora.model_dump(mode="json").items()]


def shared_base(config: RLConfig, machine: Machine) -> list[Derived]:
    """`trainer.lora.share_base` (one copy of the frozen base, the trainer's, mapped by every server) needs the
    trainer and the servers on one device: on `gpu` one GPU in both `deployment.trainer_devices` and
    `deployment.inference_devices`, on `cpu` one trainer process; one node, the `tandem` backend, no preflight (its
    own trainer process would hold a second base), and a trainer whose base is one plain tensor per weight (no FSDP
    at one rank). It decides no value."""
    if not config.trainer.lora.share_base:
        return []
    deployment = config.deployment
    key = "`trainer.lora.share_base` = true"
    refusals = [
        (config.inference.backend != "tandem", f"`inference.backend` = {config.inference.backend!r}: vLLM loads its own "
         "weights; use `inference.backend` = 'tandem'"),
        (deployment.type == "gpu" and (len(deployment.trainer_devices) != 1
                                       or set(deployment.inference_devices) != set(deployment.trainer_devices)),
         f"`deployment.trainer_devices` = {deployment.trainer_devices} and `deployment.inference_devices` = "
         f"{deployment.inference_devices}: trainer and servers must share one GPU (both [0], say)"),
        (deployment.type == "cpu" and deployment.num_trainer_processes != 1,
         f"`deployment.num_trainer_processes` = {deployment.num_trainer_processes}: one trainer holds the base; set it to 1"),
        (deployment.cluster.num_nodes > 1, f"`deployment.cluster.num_nodes` = {deployment.cluster.num_nodes}: the base "
         "is shared within one machine"),
        (config.preflight.enabled, "`preflight.enabled` = true: the preflight's trainer process would load a second "
         "base; set `preflight.enabled` = false"),
        (config.trainer.parallel.fsdp_at_one_rank, "`trainer.parallel.fsdp_at_one_rank` = true: FSDP holds the base as shards, "
         "not one tensor per weight; set it to false"),
    ]
    for refused, reason in refusals:
        if refused:
            raise ConfigError(f"{key} with {reason}")
    return []


def model_options(config: RLConfig, machine: Machine) -> list[Derived]:
    """`model.dtype` and `model.trust_remote_code`, set for the run, reach every process. Left at their defaults,
    each process keeps its own (`trainer.model.dtype = "float32"` beside a bf16 engine is a choice one can make),
    so unlike the shared keys they are written only when set."""
    defaults = ModelConfig()
    out = []
    for field in ("dtype", "trust_remote_code"):
        value = getattr(config.model, field)
        if value != getattr(defaults, field):
            out += [Derived(f"{process}.model.{field}", value, f"`model.{field}` = {value!r}") for process in PROCESSES]
    return out


def disaggregation(config: RLConfig, machine: Machine) -> list[Derived]:
    """`deployment.num_prefill_servers` and `deployment.num_decode_servers` (both or neither) run the servers as two
    pools, with tandem's engine, on one node or placed over several by `deployment.cluster.num_prefill_nodes`: each
    server's `inference.disaggregation` (its role, its prefill servers' URLs, the decode server that passes weight
    updates on to each prefill server) is set in its own config (`process_configs`). It decides no value of the shared
    config. The `shared_memory` KV transport is refused where the pools are on different nodes (CUDA IPC and
    /dev/shm are one host's), and `torch_distributed` where a prefill and a decode server share a GPU: NCCL pairs no
    two processes of one device. Across nodes `torch_distributed` meets at each prefill server's host, on a port that
    server picks and tells its decode server over HTTP, so no port is set for it."""
    deployment = config.deployment
    if not deployment.is_disaggregated:
        if config.inference.disaggregation.role != "colocated":
            raise ConfigError(f"`inference.disaggregation.role` = {config.inference.disaggregation.role!r}: under `tandem "
                              "rl` the roles come from `deployment.num_prefill_servers` and `deployment.num_decode_servers`")
        return []
    if config.inference.backend != "tandem":
        raise ConfigError("`deployment.num_prefill_servers` needs `inference.backend` = 'tandem': the KV hand-off is "
                          "tandem's engine's")
    set_by_hand = [key for key in ("role", "prefill_urls", "forward_updates_to")
                   if key in config.inference.disaggregation.model_fields_set]
    if set_by_hand:
        raise ConfigError(f"`inference.disaggregation.{set_by_hand[0]}` is decided for each server from "
                          "`deployment.num_prefill_servers` and `deployment.num_decode_servers`: remove it")
    transport = config.inference.disaggregation.kv_transport
    if transport == "shared_memory" and deployment.cluster.num_prefill_nodes:
        raise ConfigError("`inference.disaggregation.kv_transport` = 'shared_memory' with "
                          f"`deployment.cluster.num_prefill_nodes` = {deployment.cluster.num_prefill_nodes}: prefill and "
                          "decode servers are on different hosts, and CUDA IPC and /dev/shm reach one host only; set it "
                          "to 'http' or 'torch_distributed', or `num_prefill_nodes` = 0 (both pools on each node)")
    if transport == "torch_distributed" and _pools_share_a_gpu(deployment):
        raise ConfigError("`inference.disaggregation.kv_transport` = 'torch_distributed' with a prefill and a decode "
                          "server on one GPU (`deployment.disaggregated_memory_fraction`): NCCL pairs no two processes "
                          "of one device; set it to 'shared_memory' (CUDA IPC) or 'http'")
    return []


def _pools_share_a_gpu(deployment: DeploymentConfig) -> bool:
    """Whether a prefill and a decode server land on one device (placed as `inference_device_slices` places them):
    only where one node runs both pools."""
    if deployment.type != "gpu" or deployment.disaggregated_memory_fraction is None:
        return False
    roles = deployment.server_roles(deployment.cluster.num_nodes - 1)  # an inference node; with both pools, each is alike
    devices = deployment.inference_devices
    placed = [devices[i % len(devices)] for i in range(len(roles))]
    prefill = {d for d, role in zip(placed, roles) if role == "prefill"}
    return bool(prefill & {d for d, role in zip(placed, roles) if role == "decode"})


DERIVED_RULES: tuple[Rule, ...] = (model_options, nodes, trainer_ranks, devices, inference_servers,
                                   inference_device_slices, starting_model, exact, backend, weight_broadcast, lora, shared_base, resume,
                                   disaggregation)
"""Every value `tandem rl` decides for the processes; each rule reads the validated draft config."""


def parse_rl_args(argv: list[str], environ: dict[str, str] | None = None, machine: Machine | None = None) -> RLConfig:
    """`tandem rl`'s config from its command line: read, then resolved."""
    return resolve(read_args(RLConfig, argv, environ if environ is not None else dict(os.environ)), machine or LocalMachine())


def resolve(raw: RawConfig, machine: Machine) -> RLConfig:
    """The complete config of each process of an RL run (see the module docstring for the steps)."""
    data, sources = copy.deepcopy(raw.data), dict(raw.sources)
    root = validate(RLConfig, {k: v for k, v in data.items() if k not in PROCESSES}, sources)
    shared = root.model_dump(mode="json")
    for key, processes in SHARED_KEYS.items():
        value = _get(shared, key)
        for process in processes:
            _apply(data, sources, Derived(f"{process}.{key}", value, f"the shared `{key}`"), fix=f"set only the shared `{key}`")
    draft = validate(RLConfig, data, sources)
    for rule in DERIVED_RULES:
        for derived in rule(draft, machine):
            _apply(data, sources, derived, fix=f"remove `{derived.key}`")
            for shared_copy in _shared_copies(derived.key):  # copies of the shared value just checked against the user's
                _write(data, sources, Derived(shared_copy, derived.value, derived.because))
    return validate(RLConfig, data, sources)


def _shared_copies(key: str) -> list[str]:
    """Where a value decided for `key` must also go: its copies in the processes that share the key
    holding it (`weight_transport.port` -> `trainer.weight_transport.port`, ...)."""
    return [f"{process}.{key}" for shared, processes in SHARED_KEYS.items()
            if key == shared or key.startswith(shared + ".") for process in processes]


def _server_hosts(config: RLConfig) -> list[str]:
    """The address of each node as its servers' URLs name it: `deployment.cluster.hosts`, or on one node
    `inference.server.host`."""
    return cluster_hosts(config) if config.deployment.cluster.num_nodes > 1 else [config.inference.server.host]


def placed_servers(config: RLConfig) -> list[PlacedServer]:
    """Every inference server of a resolved run, on every node (`tandem.config.placement`)."""
    return place_servers(config.deployment, _server_hosts(config), config.deployment.inference_ports)


def node_servers(config: RLConfig) -> list[PlacedServer]:
    """The inference servers this node (`deployment.cluster.node_rank`) runs, in start order (prefill servers first)."""
    return [s for s in placed_servers(config) if s.node == config.deployment.cluster.node_rank]


def inference_server_names(config: RLConfig) -> list[str]:
    """The process name of each inference server of this node, in start order."""
    return [s.name for s in node_servers(config)]


def process_configs(config: RLConfig) -> dict[str, ProcessConfig]:
    """What each process of this node of a resolved run gets, by process name: one `inference` config per server of
    the node (each on its port of `deployment.inference_ports`; disaggregated, each with its `disaggregation` role and
    peers), then orchestrator and trainer. A view, not a change."""
    here = [(s, c) for s, c in server_configs(config) if s.node == config.deployment.cluster.node_rank]
    return {**{s.name: c for s, c in here}, "orchestrator": config.orchestrator, "trainer": config.trainer}


def server_configs(config: RLConfig) -> list[tuple[PlacedServer, ProcessConfig]]:
    """Every inference server of the run, on every node, with its config."""
    placed = placed_servers(config)
    return [(s, server_config(config, placed, s)) for s in placed]


def server_config(config: RLConfig, placed: list[PlacedServer], server: PlacedServer) -> ProcessConfig:
    """The config of one placed server (`placed`: every server of the run, its peers among them). It binds
    `inference.server.host` where that is every interface, else its node's own address (the same on one node; on
    loopback nodes, the one the rule `nodes` gives that node)."""
    bind = config.inference.server.host
    return config.inference.model_copy(update={
        "server": config.inference.server.model_copy(update={"port": server.port,
                                                             "host": bind if bind == "0.0.0.0" else server.host}),
        "disaggregation": server_disaggregation(config, placed, server),
        "engine": server_engine(config, server.position)})


def server_engine(config: RLConfig, i: int) -> EngineConfig:
    """`engine` of a node's server i: with servers sharing GPUs (`deployment.disaggregated_memory_fraction`), the
    k-th server to start on a GPU has `memory_fraction` k x that fraction, since an engine's budget counts what the GPU
    already holds when it starts (the servers before it on that GPU), and servers start one after the other."""
    deployment, engine = config.deployment, config.inference.engine
    fraction = deployment.disaggregated_memory_fraction
    if not deployment.is_disaggregated or fraction is None or deployment.type != "gpu":
        return engine
    slices = deployment.inference_device_slices
    started_here = sum(1 for j in range(i + 1) if slices[j] == slices[i])
    return engine.model_copy(update={"memory_fraction": min(1.0, fraction * started_here)})


def server_disaggregation(config: RLConfig, placed: list[PlacedServer], server: PlacedServer) -> DisaggregationConfig:
    """`disaggregation` of one placed server: its role, and for a decode server its prefill servers and the ones it
    passes weight updates on to (`tandem.config.placement`)."""
    own = config.inference.disaggregation
    if server.role == "colocated":
        return own
    if server.role == "prefill":
        return own.model_copy(update={"role": "prefill"})
    return own.model_copy(update={"role": "decode", "prefill_urls": [s.url for s in prefill_peers(placed, server)],
                                  "forward_updates_to": [s.url for s in updates_forwarded_by(placed, server)]})


def _apply(data: dict[str, Any], sources: dict[str, str], derived: Derived, fix: str) -> None:
    """Write `derived` into the raw config, or raise if the user set that key to something else."""
    section, leaf = _section_of(data, derived.key)
    if section is None:  # the user wrote a value where a section belongs: validation will say so
        return
    if leaf in section and section[leaf] != derived.value and section[leaf] != derived.placeholder:
        where = f" (from {sources[derived.key]})" if derived.key in sources else ""
        raise ConfigError(f"`{derived.key}` = {shown(RLConfig, derived.key, section[leaf])!r}{where} contradicts "
                          f"{derived.because}, which makes it {shown(RLConfig, derived.key, derived.value)!r}: {fix}")
    _write(data, sources, derived)


def _write(data: dict[str, Any], sources: dict[str, str], derived: Derived) -> None:
    section, leaf = _section_of(data, derived.key)
    if section is not None:
        section[leaf] = derived.value
        sources.setdefault(derived.key, derived.because)


def _section_of(data: dict[str, Any], key: str) -> tuple[dict[str, Any] | None, str]:
    """The raw section holding dotted `key` (made where missing; None where the user wrote a value instead), and its leaf."""
    *path, leaf = key.split(".")
    node = data
    for part in path:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            return None, leaf
    return node, leaf


def _get(tree: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        tree = tree[part]
    return tree
