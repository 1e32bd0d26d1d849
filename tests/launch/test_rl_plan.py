"""The launcher runs the resolved config as it is: files written verbatim, devices mapped, nothing edited."""

from __future__ import annotations

import os
import sys
import time
import tomllib

import pytest

from tandem.config.resolve import parse_rl_args
from tandem.launch.process import ManagedProcess
from tandem.launch.rl import (RunFailed, _child_env, _commands, _process_env, _starts_together, _write_process_configs,
                              wait_healthy)


class TwoGPUs:
    def num_cuda_devices(self) -> int:
        return 2

    def free_port(self) -> int:
        return 45678


def test_written_configs_are_the_resolved_ones_and_the_config_is_untouched(tmp_path):
    config = parse_rl_args(["--output-dir", str(tmp_path), "--inference.server.port", "0",
                            "--deployment.num-trainer-processes", "2"], environ={}, machine=TwoGPUs())
    before = config.model_dump()
    (tmp_path / "configs").mkdir()
    paths = _write_process_configs(config)
    assert config.model_dump() == before
    orchestrator = tomllib.loads(paths["orchestrator"].read_text())
    assert orchestrator["client"]["base_urls"] == ["http://127.0.0.1:45678"] and orchestrator["num_trainer_ranks"] == 2
    assert tomllib.loads(paths["inference"].read_text())["server"]["port"] == 45678
    assert "torch.distributed.run" in _commands(config, paths)["trainer"][0]


def test_gpu_indices_are_of_the_devices_the_launcher_sees(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert _child_env([1])["CUDA_VISIBLE_DEVICES"] == "6"
    assert _child_env([])["CUDA_VISIBLE_DEVICES"] == ""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert _child_env([0, 1])["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert "CUDA_VISIBLE_DEVICES" not in _child_env(None)


def test_each_node_runs_its_trainer_ranks_in_one_c10d_rendezvous_served_by_node_0(tmp_path):
    args = ["--output-dir", str(tmp_path), "--deployment.cluster.num-nodes", "2", "--deployment.cluster.hosts", '["h0", "h1"]',
            "--deployment.cluster.num-trainer-nodes", "2", "--deployment.num-trainer-processes", "3",
            "--inference.server.port", "8100", "--deployment.cluster.rendezvous-id", "try-2"]
    (tmp_path / "configs").mkdir()
    for rank in (0, 1):
        config = parse_rl_args([*args, "--deployment.cluster.node-rank", str(rank)], environ={}, machine=TwoGPUs())
        paths = _write_process_configs(config)
        argv = _commands(config, paths)["trainer"][0]
        joined = " ".join(argv)
        assert "--nnodes 2 --rdzv-backend c10d --rdzv-endpoint h0:29400 --rdzv-id try-2" in joined
        assert f"--rdzv-conf join_timeout=300,is_host={int(rank == 0)}" in joined and "--nproc-per-node 3" in joined
        assert (tmp_path / "configs" / f"rl.node{rank}.toml").is_file()
    assert not (tmp_path / "configs" / "rl.toml").exists()


def test_processes_start_at_once_unless_the_preflight_or_a_shared_gpu_needs_the_servers_up_first(tmp_path):
    def starts_together(*args: str) -> bool:
        return _starts_together(parse_rl_args(["--output-dir", str(tmp_path), *args], environ={}, machine=TwoGPUs()))

    gpus_apart = ("--deployment.type", "gpu", "--deployment.inference-devices", "[0]", "--deployment.trainer-devices", "[1]")
    gpu_shared = ("--deployment.type", "gpu", "--deployment.inference-devices", "[0]", "--deployment.trainer-devices", "[0]")
    assert starts_together("--deployment.type", "cpu", "--preflight.enabled", "false")
    assert starts_together(*gpus_apart, "--preflight.enabled", "false")
    assert not starts_together("--deployment.type", "cpu")  # the preflight runs between the servers and the trainer
    assert not starts_together(*gpus_apart)
    assert not starts_together(*gpu_shared, "--preflight.enabled", "false")  # the engine sizes its cache from free memory


def test_a_process_failing_beside_a_starting_server_ends_the_wait_naming_it(tmp_path):
    server = ManagedProcess("inference", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "i.log", dict(os.environ))
    trainer = ManagedProcess("trainer", [sys.executable, "-c", "print('bad config'); raise SystemExit(2)"], tmp_path / "t.log",
                             dict(os.environ))
    start = time.monotonic()
    try:
        with pytest.raises(RunFailed, match=r"the trainer process failed at start \(exit code 2\)[^|]*\| bad config"):
            wait_healthy("http://127.0.0.1:9", server, timeout_s=30, beside=[trainer])
    finally:
        server.stop()
        trainer.stop()
    assert time.monotonic() - start < 10


class OneGPU(TwoGPUs):
    def num_cuda_devices(self) -> int:
        return 1


def test_processes_sharing_a_gpu_get_expandable_segments_unless_the_caller_chose(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    gpu = ["--output-dir", str(tmp_path), "--deployment.type", "gpu"]
    shared = parse_rl_args([*gpu, "--deployment.trainer-devices", "[0]"], environ={}, machine=OneGPU())
    apart = parse_rl_args(gpu, environ={}, machine=TwoGPUs())
    assert shared.deployment.shares_a_gpu and not apart.deployment.shares_a_gpu
    for name in ("inference", "trainer", "orchestrator"):
        assert _process_env(shared, name, [0])["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
        assert "PYTORCH_CUDA_ALLOC_CONF" not in _process_env(apart, name, [0])
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert _process_env(shared, "trainer", [0])["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"
