"""Two "nodes" on localhost: two `tandem rl` launchers with their own node ranks, one run folder.

Node 0 runs trainer rank 0; node 1 runs the inference server, the orchestrator and trainer rank 1. The
trainer ranks meet in torchrun's c10d rendezvous (served by node 0), the launchers through their
heartbeat files. The run is the reverse-text example on a random tiny model, two steps.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from short_runs import env
from test_rl_e2e import EXAMPLE, REPO, steps_of, tandem

from tandem.config.resolve import free_port
from tandem.monitor.stop_signals import STOP_GRACE_S
from tandem.transport.paths import rollout_file


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from tandem.models.presets import init_model

    return init_model("tiny", tmp_path_factory.mktemp("models") / "tiny")


def node_args(tiny: Path, out: Path, rank: int, ports: tuple[int, int], max_steps: int = 2, join_timeout_s: int = 120) -> list[str]:
    return [
        "rl", "@", str(EXAMPLE / "rl.toml"), "--model.name", str(tiny), "--output-dir", str(out),
        "--max-steps", str(max_steps), "--no-ckpt.enabled", "--seq-len", "256",
        "--inference.server.port", str(ports[0]), "--inference.engine.cpu-kv-cache-gib", "0.05",
        "--orchestrator.batch-size", "4", "--orchestrator.group-size", "2", "--orchestrator.sampling.max-tokens", "8",
        "--orchestrator.eval.interval", "0",
        "--deployment.cluster.num-nodes", "2", "--deployment.cluster.hosts", '["127.0.0.1", "127.0.0.1"]',
        "--deployment.cluster.num-trainer-nodes", "2", "--deployment.cluster.rendezvous-port", str(ports[1]),
        "--deployment.cluster.rendezvous-id", "sim", "--deployment.cluster.peer-timeout-s", "5",
        "--deployment.cluster.join-timeout-s", str(join_timeout_s), "--deployment.cluster.node-rank", str(rank),
    ]


def start_node(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tandem.cli", *args], cwd=REPO, env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


pytestmark = pytest.mark.slow


def test_two_nodes_train_together_then_a_lost_node_stops_the_other(tiny, tmp_path):
    out, ports = tmp_path / "run", (free_port(), free_port())
    nodes = [start_node(node_args(tiny, out, rank, ports)) for rank in (0, 1)]
    results = [node.communicate(timeout=400) for node in nodes]
    for node, (_, stderr) in zip(nodes, results):
        assert node.returncode == 0, stderr[-3000:]
    assert steps_of(out, "trainer", "loss") == [1, 2]
    assert rollout_file(out, 2, 0).is_file() and rollout_file(out, 2, 1).is_file()
    assert (out / "logs" / "trainer.node0.log").is_file() and (out / "logs" / "orchestrator.node1.log").is_file()

    out, ports = tmp_path / "lost", (free_port(), free_port())
    nodes = [start_node(node_args(tiny, out, rank, ports, max_steps=50)) for rank in (0, 1)]
    try:
        deadline = time.monotonic() + 300
        while not steps_of(out, "trainer", "loss") and time.monotonic() < deadline:
            assert all(node.poll() is None for node in nodes)
            time.sleep(0.5)
        nodes[1].send_signal(signal.SIGKILL)  # the whole "node": its launcher, whose children then die with it
        killed_at = time.monotonic()
        _, stderr = nodes[0].communicate(timeout=60)
        assert time.monotonic() - killed_at < 60
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    assert nodes[0].returncode != 0
    assert "lost node 1 (127.0.0.1): no heartbeat for 5 s" in stderr, stderr[-3000:]
    for pid in json.loads((out / "logs" / "pids.node0.json").read_text()).values():
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)
    # nor any trainer rank, in torchrun's sessions of their own: one waiting in a collective with the lost node's rank
    # ends by its watchdog within the grace of its stop
    deadline = time.monotonic() + STOP_GRACE_S + 10
    while processes_naming(out) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes_naming(out)


def processes_naming(folder: Path) -> list[str]:
    """The command lines that name `folder` (a run's processes pass it their configs) of processes not yet ended:
    a zombie, ended and waiting for its new parent to reap it, does not count."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            ended = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        except (OSError, IndexError):  # not a process, or one that ended meanwhile
            continue
        if str(folder) in command and not ended:
            found.append(command)
    return found


def test_a_node_that_never_comes_is_named_within_the_join_timeout(tiny, tmp_path):
    started = time.monotonic()
    result = tandem(*node_args(tiny, tmp_path / "alone", 0, (free_port(), free_port()), join_timeout_s=2), timeout=60)
    assert result.returncode == 1 and time.monotonic() - started < 30
    assert "node 1 (127.0.0.1) did not join within 2 s (`deployment.cluster.join_timeout_s`)" in result.stderr
