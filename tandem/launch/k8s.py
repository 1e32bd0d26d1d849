"""`tandem rl --k8s`: the Kubernetes objects of a run, one role per workload.

- a ConfigMap with each process's resolved config, mounted at `/config` (secrets redacted);
- a Secret holding the secrets those configs lack (`tandem.config.secret`), when the run has any: each
  container gets those of its process as the environment variables that override its config file;
- a ReadWriteMany volume claim for the run folder, mounted in every pod at the run folder's path
  (under the working directory `/workspace` when it is relative), so the configs need no rewriting;
- the inference servers: a StatefulSet behind a headless Service, so that pod j is
  `<run>-inference-<j>.<run>-inference`, the host the resolution put into `orchestrator.client.base_urls`.
  Disaggregated, that StatefulSet holds the decode servers, each pod reading its own config
  (`inference-<j>.toml`: the prefill servers it passes weight updates on to are its own), and a second one,
  `<run>-prefill` behind its Service, the prefill servers (`prefill.toml`), at the hosts the decode configs name;
- the trainer: an Indexed Job of `num_trainer_nodes` pods behind a headless Service, torchrun in each,
  meeting in the c10d rendezvous served by pod 0 (`<run>-trainer-0.<run>-trainer`);
- the orchestrator: a Job of one pod.

Jobs never retry (`backoffLimit: 0`): a failed trainer or orchestrator fails its Job, and
`kubectl delete -f` removes the whole run. Objects are written as JSON documents (which are YAML).
"""

from __future__ import annotations

import json
import shlex
from pathlib import PurePosixPath
from typing import Any

from tandem.config.dump import to_toml
from tandem.config.loader import secret_env
from tandem.config.resolve import PROCESSES, cluster_hosts, placed_servers, server_config
from tandem.config.rl import RLConfig
from tandem.config.secret import REDACTED
from tandem.launch.torchrun import trainer_argv

WORKDIR = PurePosixPath("/workspace")
CONFIG_DIR = PurePosixPath("/config")


def render_manifests(config: RLConfig) -> list[dict[str, Any]]:
    """Every object of the run, in the order `kubectl apply` should create them."""
    k8s, cluster = config.deployment.k8s, config.deployment.cluster

    def name(role: str) -> str:
        return k8s.object_name(config.run.name, role)

    def meta(role: str) -> dict[str, Any]:
        return {"name": name(role), "namespace": k8s.namespace, "labels": _labels(config, role)}

    configs = {f"{p}.toml": to_toml(getattr(config, p)) for p in PROCESSES if p != "inference"} | _server_configs(config)
    configmap = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta("config"), "data": configs}
    values = {_secret_key(p, name): value for p in PROCESSES for name, value in secret_env(getattr(config, p)).items()}
    secret = [{"apiVersion": "v1", "kind": "Secret", "metadata": meta("secrets"), "type": "Opaque",
               "stringData": values}] if values else []
    claim_spec: dict[str, Any] = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": k8s.storage}}}
    if k8s.storage_class:
        claim_spec["storageClassName"] = k8s.storage_class
    claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta("run"), "spec": claim_spec}
    port = config.inference.server.port
    num_prefill = cluster.num_prefill_nodes if config.deployment.is_disaggregated else 0

    def servers(role: str, replicas: int, command: list[str]) -> dict[str, Any]:
        return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": meta(role), "spec": {
            "serviceName": name(role), "replicas": replicas, "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": _labels(config, role)},
            "template": _pod(config, role, command, "Always", ports=[port], gpus=_gpus(config, "inference"),
                             probe={"httpGet": {"path": "/health", "port": port}, "periodSeconds": 5},
                             process="inference")}}

    # A decode pod's config is its own: a StatefulSet pod's host name ends in its ordinal.
    decode_command = ["sh", "-c", "exec " + shlex.join(_tandem("inference")).replace(
        "inference.toml", "inference-${HOSTNAME##*-}.toml")] if num_prefill else _tandem("inference")
    inference = servers("inference", cluster.num_inference_nodes - num_prefill, decode_command)
    prefill = [servers("prefill", num_prefill, _tandem("inference", "prefill.toml"))] if num_prefill else []
    trainer_script = shlex.join(trainer_argv(config.deployment, str(CONFIG_DIR / "trainer.toml"), cluster_hosts(config)[0],
                                             "__IS_HOST__", python="python"))
    # Pod 0 serves the rendezvous store; torchrun cannot tell from its host name, so each pod says so.
    trainer_script = ('is_host=0; [ "$JOB_COMPLETION_INDEX" = 0 ] && is_host=1; exec '
                      + trainer_script.replace("__IS_HOST__", '"$is_host"'))
    trainer = _job(config, "trainer", meta("trainer"), cluster.num_trainer_nodes, ["sh", "-c", trainer_script],
                   ports=[cluster.rendezvous_port], gpus=_gpus(config, "trainer"))
    trainer["spec"]["completionMode"] = "Indexed"
    trainer["spec"]["template"]["spec"]["subdomain"] = name("trainer")
    orchestrator = _job(config, "orchestrator", meta("orchestrator"), 1, _tandem("orchestrator"), ports=[], gpus=0)
    services = [_headless_service(config, meta(role), role, p) for role, p in
                ((("prefill", port),) if num_prefill else ()) + (("inference", port), ("trainer", cluster.rendezvous_port))]
    return [configmap, *secret, claim, *services, *prefill, inference, trainer, orchestrator]


def _server_configs(config: RLConfig) -> dict[str, str]:
    """The servers' configs: the colocated servers' `inference.toml`, or disaggregated the prefill pods'
    (`prefill.toml`, one for all) and each decode pod's (`inference-<j>.toml`)."""
    if not config.deployment.is_disaggregated:
        return {"inference.toml": to_toml(config.inference)}
    placed = placed_servers(config)
    first_decode = next(s.node for s in placed if s.role == "decode")
    files = {"prefill.toml": to_toml(server_config(config, placed, next(s for s in placed if s.role == "prefill")))}
    return files | {f"inference-{s.node - first_decode}.toml": to_toml(server_config(config, placed, s))
                    for s in placed if s.role == "decode"}


def to_documents(objects: list[dict[str, Any]]) -> str:
    return "".join(f"---\n{json.dumps(obj, indent=2)}\n" for obj in objects)


def redacted(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`objects` as they may be shown: each value of a Secret replaced by `REDACTED`."""
    return [{**obj, "stringData": dict.fromkeys(obj["stringData"], REDACTED)} if obj["kind"] == "Secret" else obj
            for obj in objects]


def _secret_key(process: str, variable: str) -> str:
    """The key of the run's Secret that holds environment variable `variable` of `process`."""
    return f"{process}.{variable}"


def _labels(config: RLConfig, role: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "tandem", "app.kubernetes.io/instance": config.deployment.k8s.object_name(config.run.name, "run"),
            "app.kubernetes.io/component": role}


def _tandem(process: str, config_file: str | None = None) -> list[str]:
    return ["python", "-m", "tandem.cli", process, "@", str(CONFIG_DIR / (config_file or f"{process}.toml"))]


def _gpus(config: RLConfig, role: str) -> int:
    deployment = config.deployment
    if deployment.type != "gpu":
        return 0
    return len(deployment.inference_devices if role == "inference" else deployment.trainer_devices)


def _pod(config: RLConfig, role: str, command: list[str], restart: str, ports: list[int], gpus: int,
         probe: dict | None = None, process: str | None = None) -> dict[str, Any]:
    """The pod template of `role`, whose container runs `process` (default: the role) and gets its secrets."""
    k8s = config.deployment.k8s
    process = process or role
    run_path = WORKDIR / config.run_dir.as_posix()
    container: dict[str, Any] = {
        "name": role, "image": k8s.image, "command": command, "workingDir": str(WORKDIR),
        "env": [{"name": "PYTHONUNBUFFERED", "value": "1"},
                *({"name": variable, "valueFrom": {"secretKeyRef": {"name": k8s.object_name(config.run.name, "secrets"),
                                                                     "key": _secret_key(process, variable)}}}
                  for variable in secret_env(getattr(config, process)))],
        "ports": [{"containerPort": p} for p in ports],
        "volumeMounts": [{"name": "config", "mountPath": str(CONFIG_DIR), "readOnly": True},
                         {"name": "run", "mountPath": str(run_path)}],
    }
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": gpus}}
    if probe:
        container["readinessProbe"] = probe
    return {"metadata": {"labels": _labels(config, role)}, "spec": {
        "restartPolicy": restart, "containers": [container],
        "volumes": [{"name": "config", "configMap": {"name": k8s.object_name(config.run.name, "config")}},
                    {"name": "run", "persistentVolumeClaim": {"claimName": k8s.object_name(config.run.name, "run")}}]}}


def _job(config: RLConfig, role: str, metadata: dict, pods: int, command: list[str], ports: list[int], gpus: int) -> dict[str, Any]:
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata, "spec": {
        "completions": pods, "parallelism": pods, "backoffLimit": 0,
        "template": _pod(config, role, command, "Never", ports=ports, gpus=gpus)}}


def _headless_service(config: RLConfig, metadata: dict, role: str, port: int) -> dict[str, Any]:
    # Headless, and publishing pods before they are ready: the trainer's rendezvous needs the names at start.
    return {"apiVersion": "v1", "kind": "Service", "metadata": metadata, "spec": {
        "clusterIP": "None", "publishNotReadyAddresses": True, "selector": _labels(config, role),
        "ports": [{"name": role, "port": port}]}}
