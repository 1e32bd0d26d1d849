"""Prefill and decode pools over several nodes: which node runs which server, at which address, with which peers,
as every node's launcher resolves it (`deployment.cluster.num_prefill_nodes`, `tandem.config.placement`)."""

from __future__ import annotations

import pytest
from test_resolve import FakeMachine, resolve

from tandem.config.dump import dump_process_configs
from tandem.config.loader import ConfigError
from tandem.config.resolve import process_configs

PORT = ("--inference.server.port", "9200")


def cluster(hosts: list[str], *extra: str) -> tuple[str, ...]:
    quoted = ", ".join(f'"{h}"' for h in hosts)
    return ("--deployment.cluster.num-nodes", str(len(hosts)), "--deployment.cluster.hosts", f"[{quoted}]", *PORT, *extra)


def pools(num_prefill: int, num_decode: int) -> tuple[str, ...]:
    return ("--deployment.num-prefill-servers", str(num_prefill), "--deployment.num-decode-servers", str(num_decode))


def servers_of(*argv: str, nodes: int, machine: FakeMachine | None = None) -> list[dict[str, dict]]:
    """Each node's inference servers (name -> its config), as that node resolves the command line."""
    out = []
    for rank in range(nodes):
        config = resolve(*argv, "--deployment.cluster.node-rank", str(rank), machine=machine)
        out.append({name: c for name, c in process_configs(config).items() if name not in ("orchestrator", "trainer")})
    return out


def test_two_nodes_one_prefill_node_and_one_decode_node_with_the_orchestrator():
    argv = cluster(["a", "b"], "--deployment.cluster.num-inference-nodes", "2", "--deployment.cluster.num-prefill-nodes",
                   "1", *pools(1, 1))
    node0, node1 = (resolve(*argv, "--deployment.cluster.node-rank", str(r)) for r in (0, 1))
    assert node0.deployment.cluster.roles(0) == ["inference", "trainer"]
    assert node1.deployment.cluster.roles(1) == ["inference", "orchestrator"]
    assert node0.orchestrator.client.base_urls == node1.orchestrator.client.base_urls == ["http://b:9200"]
    on_a, on_b = servers_of(*argv, nodes=2)
    assert list(on_a) == ["prefill"] and list(on_b) == ["inference"]
    assert on_a["prefill"].disaggregation.role == "prefill" and on_a["prefill"].server.port == 9200
    decode = on_b["inference"].disaggregation
    assert (decode.role, decode.prefill_urls, decode.forward_updates_to) == ("decode", ["http://a:9200"], ["http://a:9200"])
    assert on_a["prefill"].server.host == on_b["inference"].server.host == "0.0.0.0"  # reached from the other node


def test_three_nodes_a_trainer_node_then_two_prefill_servers_then_three_decode_servers():
    argv = cluster(["t", "p", "d"], "--deployment.cluster.num-inference-nodes", "2",
                   "--deployment.cluster.num-prefill-nodes", "1", *pools(2, 3))
    config = resolve(*argv)
    assert [config.deployment.cluster.roles(n) for n in range(3)] == [["trainer"], ["inference"], ["inference", "orchestrator"]]
    assert config.deployment.inference_ports == [9200, 9201, 9202]  # the busiest node's: its three decode servers
    assert config.orchestrator.client.base_urls == ["http://d:9200", "http://d:9201", "http://d:9202"]
    on_t, on_p, on_d = servers_of(*argv, nodes=3)
    assert on_t == {}
    assert {name: (c.disaggregation.role, c.server.port) for name, c in on_p.items()} == \
        {"prefill": ("prefill", 9200), "prefill_1": ("prefill", 9201)}
    assert list(on_d) == ["inference", "inference_1", "inference_2"]
    prefill = ["http://p:9200", "http://p:9201"]
    assert all(c.disaggregation.prefill_urls == prefill for c in on_d.values())
    # Each prefill server gets its weight updates from exactly one decode server.
    assert [c.disaggregation.forward_updates_to for c in on_d.values()] == [[prefill[0]], [prefill[1]], []]
    # `--dry-run` on any node shows every server of the run, named as its node's log file.
    shown = {s.split(" ----")[0]: s.split("\n")[1] for s in dump_process_configs(config).split("# ---- ")[1:]}
    assert shown == {"prefill.node1": "# runs on: the CPU of node(s) 1 (p)", "prefill_1.node1": "# runs on: the CPU of node(s) 1 (p)",
                     "inference.node2": "# runs on: the CPU of node(s) 2 (d)", "inference_1.node2": "# runs on: the CPU of node(s) 2 (d)",
                     "inference_2.node2": "# runs on: the CPU of node(s) 2 (d)", "orchestrator": "# runs on: the CPU of node(s) 2 (d)",
                     "trainer": "# runs on: 1 rank(s) on the CPU of node(s) 0 (t)"}


def test_without_prefill_nodes_every_inference_node_runs_both_pools_and_keeps_its_kv_at_home():
    argv = cluster(["t", "i1", "i2"], "--deployment.cluster.num-inference-nodes", "2", *pools(1, 2),
                   "--inference.disaggregation.kv-transport", "shared_memory")
    config = resolve(*argv)
    assert config.orchestrator.client.base_urls == ["http://i1:9201", "http://i1:9202", "http://i2:9201", "http://i2:9202"]
    _, on_1, on_2 = servers_of(*argv, nodes=3)
    assert list(on_1) == list(on_2) == ["prefill", "inference", "inference_1"]
    for host, servers in (("i1", on_1), ("i2", on_2)):
        decode = [servers["inference"].disaggregation, servers["inference_1"].disaggregation]
        assert decode[0].prefill_urls == decode[1].prefill_urls == [f"http://{host}:9200"]
        assert (decode[0].forward_updates_to, decode[1].forward_updates_to) == ([f"http://{host}:9200"], [])


def test_on_gpus_each_node_takes_the_first_device_slices_it_needs():
    argv = cluster(["p", "d"], "--deployment.cluster.num-inference-nodes", "2", "--deployment.cluster.num-prefill-nodes",
                   "1", "--deployment.cluster.num-trainer-nodes", "1", *pools(1, 2), "--deployment.type", "gpu",
                   "--deployment.inference-devices", "[0, 1]", "--deployment.trainer-devices", "[2]")
    machine = FakeMachine(cuda_devices=3)
    assert resolve(*argv, machine=machine).deployment.inference_device_slices == [[0], [1]]
    on_p, on_d = servers_of(*argv, nodes=2, machine=machine)
    assert (list(on_p), list(on_d)) == (["prefill"], ["inference", "inference_1"])
    with pytest.raises(ConfigError, match=r"the busiest node's `num_prefill_servers` or `num_decode_servers` = 2 servers "
                                          r"but `inference_devices` = \[0\] lists 1 GPU"):
        resolve(*argv, "--deployment.inference-devices", "[0]", machine=machine)


def test_loopback_nodes_bind_their_own_address():
    argv = cluster(["127.0.0.1", "127.0.0.2"], "--deployment.cluster.num-inference-nodes", "2",
                   "--deployment.cluster.num-prefill-nodes", "1", *pools(1, 1))
    hosts = [resolve(*argv, "--deployment.cluster.node-rank", str(r)).inference.server.host for r in (0, 1)]
    assert hosts == ["127.0.0.1", "127.0.0.2"]
    on_0, on_1 = servers_of(*argv, nodes=2)
    assert (on_0["prefill"].server.host, on_1["inference"].server.host) == ("127.0.0.1", "127.0.0.2")
    assert on_1["inference"].disaggregation.prefill_urls == [f"http://127.0.0.1:{PORT[1]}"]


def test_placement_errors_name_the_keys():
    two = cluster(["a", "b"], "--deployment.cluster.num-inference-nodes", "2")
    with pytest.raises(ConfigError, match=r"`inference.disaggregation.kv_transport` = 'shared_memory' with `deployment.cluster.num_prefill_nodes` "
                                          r"= 1: prefill and decode servers are on different hosts"):
        resolve(*two, "--deployment.cluster.num-prefill-nodes", "1", *pools(1, 1),
                "--inference.disaggregation.kv-transport", "shared_memory")
    torch_distributed = resolve(*two, "--deployment.cluster.num-prefill-nodes", "1", *pools(1, 1),
                                "--inference.disaggregation.kv-transport", "torch_distributed")
    assert torch_distributed.inference.disaggregation.kv_transport == "torch_distributed"
    with pytest.raises(ConfigError, match=r"`num_prefill_nodes` = 2 leaves no node of `num_inference_nodes` = 2 for the "
                                          r"decode servers"):
        resolve(*two, "--deployment.cluster.num-prefill-nodes", "2", *pools(1, 1))
    with pytest.raises(ConfigError, match=r"`cluster.num_prefill_nodes` = 1 but `num_prefill_servers` and "
                                          r"`num_decode_servers` are 0"):
        resolve(*two, "--deployment.cluster.num-prefill-nodes", "1")


K8S = ("--deployment.launcher", "k8s", "--run.name", "rt", "--deployment.cluster.num-nodes", "3",
       "--deployment.cluster.num-inference-nodes", "2")


def test_k8s_puts_each_pool_in_pods_of_its_own():
    config = resolve(*K8S, "--deployment.cluster.num-prefill-nodes", "1", *pools(1, 1))
    assert config.deployment.cluster.hosts == ["rt-trainer-0.rt-trainer", "rt-prefill-0.rt-prefill",
                                               "rt-inference-0.rt-inference"]
    assert config.orchestrator.client.base_urls == ["http://rt-inference-0.rt-inference:8000"]
    with pytest.raises(ConfigError, match=r"'k8s' with `deployment.num_prefill_servers` runs each pool in pods of its "
                                          r"own: set `deployment.cluster.num_prefill_nodes`"):
        resolve(*K8S, *pools(1, 1))
    with pytest.raises(ConfigError, match=r"'k8s' runs one inference server per pod: set `deployment.num_decode_servers` = 1"):
        resolve(*K8S, "--deployment.cluster.num-prefill-nodes", "1", *pools(1, 2))
