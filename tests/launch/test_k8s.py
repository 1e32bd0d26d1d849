"""`tandem rl --k8s`: the manifests, validated against the Kubernetes 1.37 schemas (`kubernetes-validate`,
offline: the schemas ship in the package), and wired to each other: the names the resolved configs use are
the names the Services give the pods."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tandem.config.resolve import parse_rl_args
from tandem.launch.k8s import render_manifests, to_documents

kubernetes_validate = pytest.importorskip("kubernetes_validate")


class NoGPU:
    def num_cuda_devices(self) -> int:
        return 0

    def free_port(self) -> int:
        raise AssertionError("a multi-node run never picks a free port")


def manifests(num_trainer_nodes: int, *extra: str) -> dict[str, dict]:
    config = parse_rl_args(["--deployment.launcher", "k8s", "--deployment.type", "gpu", "--run.name", "rt",
                            "--deployment.trainer-devices", "[0, 1, 2, 3, 4, 5, 6, 7]", "--deployment.inference-devices", "[0]",
                            "--deployment.cluster.num-nodes", str(num_trainer_nodes + 1),
                            "--deployment.cluster.num-trainer-nodes", str(num_trainer_nodes), *extra],
                           environ={}, machine=NoGPU())
    objects = render_manifests(config)
    for obj in objects:
        kubernetes_validate.validate(obj, "1.37.0", strict=True)
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in objects}


@pytest.mark.parametrize("num_trainer_nodes", [1, 4])
def test_manifests_are_valid_and_their_names_agree(num_trainer_nodes):
    objects = manifests(num_trainer_nodes, "--deployment.k8s.storage-class", "nfs")
    assert set(objects) == {"ConfigMap/rt-config", "PersistentVolumeClaim/rt-run", "Service/rt-inference", "Service/rt-trainer",
                            "StatefulSet/rt-inference", "Job/rt-trainer", "Job/rt-orchestrator"}
    configs = {name: tomllib.loads(text) for name, text in objects["ConfigMap/rt-config"]["data"].items()}
    assert configs["orchestrator.toml"]["client"]["base_urls"] == ["http://rt-inference-0.rt-inference:8000"]
    assert configs["orchestrator.toml"]["num_trainer_ranks"] == 8 * num_trainer_nodes
    assert configs["inference.toml"]["server"]["host"] == "0.0.0.0"
    assert objects["StatefulSet/rt-inference"]["spec"]["serviceName"] == "rt-inference"

    trainer = objects["Job/rt-trainer"]["spec"]
    assert (trainer["completions"], trainer["parallelism"], trainer["completionMode"], trainer["backoffLimit"]) == \
        (num_trainer_nodes, num_trainer_nodes, "Indexed", 0)
    assert trainer["template"]["spec"]["subdomain"] == "rt-trainer"
    container = trainer["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    script = container["command"][2]
    assert "--nproc-per-node 8" in script
    if num_trainer_nodes > 1:
        assert f"--nnodes {num_trainer_nodes} --rdzv-backend c10d --rdzv-endpoint rt-trainer-0.rt-trainer:29400" in script
        assert 'is_host="$is_host"' in script
    assert objects["PersistentVolumeClaim/rt-run"]["spec"]["storageClassName"] == "nfs"
    for workload in ("StatefulSet/rt-inference", "Job/rt-trainer", "Job/rt-orchestrator"):
        mounts = objects[workload]["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
        assert {"name": "run", "mountPath": "/workspace/outputs/rt"} in mounts


def test_the_validator_catches_a_broken_manifest():
    # the check above must be able to fail: a Job without its pod template is refused
    job = manifests(1)["Job/rt-orchestrator"]
    broken = json.loads(json.dumps(job))
    del broken["spec"]["template"]["spec"]["containers"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, "1.37.0", strict=True)
    assert to_documents([job]).startswith("---\n{")


def test_tandem_rl_k8s_prints_or_writes_the_manifests(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")} | {"PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    argv = [sys.executable, "-m", "tandem.cli", "rl", "--deployment.cluster.num-nodes", "2", "--k8s"]
    printed = subprocess.run([*argv, "--dry-run"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert printed.returncode == 0, printed.stderr
    assert "# ---- trainer ----" in printed.stdout and '"kind": "StatefulSet"' in printed.stdout
    assert not (tmp_path / "outputs").exists()
    written = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert written.returncode == 0, written.stderr
    path = tmp_path / "outputs" / "default" / "k8s" / "manifests.yaml"
    assert f"kubectl apply -f {Path('outputs/default/k8s/manifests.yaml')}" in written.stdout
    assert path.read_text() == printed.stdout.split("# ---- k8s ----\n")[1]


def test_disaggregated_pools_are_a_statefulset_each_and_every_host_a_config_names_is_a_pod_a_service_creates():
    config = parse_rl_args(["--deployment.launcher", "k8s", "--deployment.type", "gpu", "--run.name", "rt",
                            "--deployment.trainer-devices", "[0]", "--deployment.inference-devices", "[0]",
                            "--deployment.cluster.num-nodes", "5", "--deployment.cluster.num-inference-nodes", "4",
                            "--deployment.cluster.num-prefill-nodes", "2", "--deployment.num-prefill-servers", "1",
                            "--deployment.num-decode-servers", "1", "--inference.disaggregation.kv-transport",
                            "torch_distributed"], environ={}, machine=NoGPU())
    listed = render_manifests(config)
    for obj in listed:
        kubernetes_validate.validate(obj, "1.37.0", strict=True)
    objects = {f"{o['kind']}/{o['metadata']['name']}": o for o in listed}
    assert {"Service/rt-prefill", "StatefulSet/rt-prefill", "Service/rt-inference", "StatefulSet/rt-inference"} <= set(objects)
    assert (objects["StatefulSet/rt-prefill"]["spec"]["replicas"], objects["StatefulSet/rt-inference"]["spec"]["replicas"]) == (2, 2)
    data = objects["ConfigMap/rt-config"]["data"]
    assert set(data) == {"orchestrator.toml", "trainer.toml", "prefill.toml", "inference-0.toml", "inference-1.toml"}
    configs = {name: tomllib.loads(text) for name, text in data.items()}
    assert configs["prefill.toml"]["disaggregation"]["role"] == "prefill"
    assert configs["prefill.toml"]["server"]["host"] == "0.0.0.0"

    # Each decode pod reads the config of its ordinal.
    decode_pod = objects["StatefulSet/rt-inference"]["spec"]["template"]["spec"]["containers"][0]
    for ordinal in range(2):
        shown = subprocess.run(["sh", "-c", decode_pod["command"][2].replace("exec ", "echo ", 1)], env={"HOSTNAME": f"rt-inference-{ordinal}"},
                               capture_output=True, text=True, check=True).stdout.split()
        assert shown[-1] == f"/config/inference-{ordinal}.toml" and configs[f"inference-{ordinal}.toml"]["disaggregation"]["role"] == "decode"
    decode = [configs[f"inference-{j}.toml"]["disaggregation"] for j in range(2)]
    prefill_urls = ["http://rt-prefill-0.rt-prefill:8000", "http://rt-prefill-1.rt-prefill:8000"]
    assert decode[0]["prefill_urls"] == decode[1]["prefill_urls"] == prefill_urls
    assert sorted(decode[0]["forward_updates_to"] + decode[1]["forward_updates_to"]) == prefill_urls  # once each

    # Every host a config names is pod i of a StatefulSet, published by the headless Service it names.
    urls = configs["orchestrator.toml"]["client"]["base_urls"] + [u for d in decode for u in d["prefill_urls"]]
    assert configs["orchestrator.toml"]["client"]["base_urls"] == ["http://rt-inference-0.rt-inference:8000",
                                                                   "http://rt-inference-1.rt-inference:8000"]
    for url in urls:
        host, port = url.removeprefix("http://").split(":")
        pod, service_name = host.split(".")
        workload, ordinal = pod.rsplit("-", 1)
        stateful_set = objects[f"StatefulSet/{workload}"]
        service = objects[f"Service/{service_name}"]
        assert stateful_set["spec"]["serviceName"] == service_name and int(ordinal) < stateful_set["spec"]["replicas"]
        assert service["spec"]["clusterIP"] == "None"
        pod_spec = stateful_set["spec"]["template"]
        assert service["spec"]["selector"].items() <= pod_spec["metadata"]["labels"].items()
        assert {"containerPort": int(port)} in pod_spec["spec"]["containers"][0]["ports"]
