"""Prefill and decode pools on two "nodes" on localhost: two `tandem rl` launchers with their own node ranks, one
run folder, placed by `deployment.cluster.num_prefill_nodes` = 1: node 0 runs the prefill server and the trainer,
node 1 the decode server and the orchestrator. The decode server reaches the prefill server only through the
address the resolution gave it, and the KV cache crosses between the two launchers' processes over HTTP or a gloo
pair group. The run is the reverse-text example on a random tiny model, two steps.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from test_rl_e2e import EXAMPLE, steps_of
from test_rl_nodes import start_node

from tandem.config.resolve import free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from tandem.models.presets import init_model

    return init_model("tiny", tmp_path_factory.mktemp("models") / "tiny")


def node_args(tiny: Path, out: Path, rank: int, port: int, kv_transport: str) -> list[str]:
    return [
        "rl", "@", str(EXAMPLE / "rl.toml"), "--model.name", str(tiny), "--output-dir", str(out),
        "--max-steps", "2", "--no-ckpt.enabled", "--seq-len", "256", "--preflight.enabled", "false",
        "--inference.server.port", str(port), "--inference.engine.cpu-kv-cache-gib", "0.05",
        "--orchestrator.batch-size", "4", "--orchestrator.group-size", "2", "--orchestrator.sampling.max-tokens", "8",
        "--orchestrator.eval.interval", "0",
        "--deployment.num-prefill-servers", "1", "--deployment.num-decode-servers", "1",
        "--inference.disaggregation.min-remote-prefill-tokens", "1", "--inference.disaggregation.kv-transport", kv_transport,
        "--deployment.cluster.num-nodes", "2", "--deployment.cluster.hosts", '["127.0.0.1", "127.0.0.2"]',
        "--deployment.cluster.num-inference-nodes", "2", "--deployment.cluster.num-prefill-nodes", "1",
        "--deployment.cluster.rendezvous-id", "pd", "--deployment.cluster.peer-timeout-s", "10",
        "--deployment.cluster.join-timeout-s", "120", "--deployment.cluster.node-rank", str(rank),
    ]


@pytest.mark.parametrize("kv_transport", ["http", "torch_distributed"])
def test_a_prefill_node_and_a_decode_node_train_together_and_hand_prompts_over(tiny, tmp_path, kv_transport):
    out = tmp_path / "run"
    port = free_port()  # each node's server takes it, on its own loopback address
    nodes = [start_node(node_args(tiny, out, rank, port, kv_transport)) for rank in (0, 1)]
    results = [node.communicate(timeout=300) for node in nodes]
    for node, (_, stderr) in zip(nodes, results):
        assert node.returncode == 0, stderr[-3000:]
    assert steps_of(out, "trainer", "loss") == [1, 2]
    decode_log = (out / "logs" / "inference.node1.log").read_text()
    handed = re.search(r"prompts handed over by prefill servers: (\d+)", decode_log)
    assert handed and int(handed.group(1)) > 0, decode_log[-3000:]
    # The blocks came through the transport asked for, from node 0's address, which also got the weight updates.
    prefill = f"http://127.0.0.1:{port}"
    via = f"POST {prefill}/kv/pairs" if kv_transport == "torch_distributed" else f"GET {prefill}/kv/"
    assert via in decode_log and f"POST {prefill}/update_weights" in decode_log
    assert (out / "logs" / "prefill.node0.log").is_file() and not (out / "logs" / "inference.node0.log").exists()
    decode = tomllib.loads((out / "configs" / "inference.node1.toml").read_text())
    assert decode["disaggregation"]["prefill_urls"] == [f"http://127.0.0.1:{port}"]  # node 0's host
    assert decode["server"]["host"] == "127.0.0.2"
