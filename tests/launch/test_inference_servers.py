"""`tandem rl` starts the inference servers the resolved plan lists: one config, command and device slice each.

What is decided for them (ports, URLs, slices, the broadcast group) is tested with its rule in
`tests/config/test_resolve.py`; here, only that the launcher carries it out unchanged.
"""

from __future__ import annotations

import tomllib

from tandem.config.resolve import parse_rl_args
from tandem.launch.rl import _commands, _server_urls, _starts_together, _write_process_configs


class Machine:
    def __init__(self, cuda_devices: int = 0) -> None:
        self.cuda_devices, self.port = cuda_devices, 47000

    def num_cuda_devices(self) -> int:
        return self.cuda_devices

    def free_port(self) -> int:
        self.port += 1
        return self.port


def test_two_cpu_servers_get_their_own_configs_and_commands(tmp_path):
    config = parse_rl_args(["--output-dir", str(tmp_path), "--deployment.num_inference_servers", "2",
                            "--inference.server.port", "0"], environ={}, machine=Machine())
    (tmp_path / "configs").mkdir()
    paths = _write_process_configs(config)
    ports = [tomllib.loads(paths[name].read_text())["server"]["port"] for name in ("inference", "inference_1")]
    assert ports == config.deployment.inference_ports == [47001, 47002]
    assert tomllib.loads(paths["orchestrator"].read_text())["client"]["base_urls"] == [f"http://127.0.0.1:{p}" for p in ports]
    commands = _commands(config, paths)
    assert [name for name in commands if name.startswith("inference")] == ["inference", "inference_1"]
    assert commands["inference_1"] == ([*commands["inference"][0][:-1], str(paths["inference_1"])], None)


def test_gpu_servers_run_on_their_device_slices(tmp_path):
    config = parse_rl_args(["--output-dir", str(tmp_path), "--deployment.type", "gpu", "--deployment.num_inference_servers", "2",
                            "--inference.backend", "vllm", "--inference.vllm.tensor_parallel_size", "2",
                            "--weight_transport.type", "broadcast", "--deployment.inference_devices", "[0, 1, 2, 3]",
                            "--deployment.trainer_devices", "[4]"], environ={}, machine=Machine(cuda_devices=5))
    (tmp_path / "configs").mkdir()
    commands = _commands(config, _write_process_configs(config))
    assert [commands[name][1] for name in ("inference", "inference_1", "trainer")] == [[0, 1], [2, 3], [4]]


def test_each_node_checks_its_own_servers_on_loopback(tmp_path):
    two_nodes = ["--output-dir", str(tmp_path), "--deployment.num_inference_servers", "2", "--inference.server.port", "8100",
                 "--deployment.cluster.num_nodes", "2", "--deployment.cluster.hosts", '["n0", "n1"]']
    config = parse_rl_args([*two_nodes, "--deployment.cluster.node_rank", "1"], environ={}, machine=Machine())
    assert config.orchestrator.client.base_urls == ["http://n1:8100", "http://n1:8101"]
    assert _server_urls(config) == {"inference": "http://127.0.0.1:8100", "inference_1": "http://127.0.0.1:8101"}
    one_node = parse_rl_args(two_nodes[:6], environ={}, machine=Machine())
    assert _server_urls(one_node) == {"inference": "http://127.0.0.1:8100", "inference_1": "http://127.0.0.1:8101"}
    assert list(_server_urls(one_node).values()) == one_node.orchestrator.client.base_urls


def test_disaggregated_pools_start_prefill_servers_first_each_with_its_role(tmp_path):
    config = parse_rl_args(["--output-dir", str(tmp_path), "--deployment.num_prefill_servers", "1",
                            "--deployment.num_decode_servers", "2", "--inference.server.port", "0"],
                           environ={}, machine=Machine())
    (tmp_path / "configs").mkdir()
    paths = _write_process_configs(config)
    urls = _server_urls(config)
    assert list(urls) == ["prefill", "inference", "inference_1"]  # the start order: a decode server checks its peers
    assert list(urls.values()) == [f"http://127.0.0.1:{p}" for p in (47001, 47002, 47003)]
    written = {name: tomllib.loads(paths[name].read_text())["disaggregation"] for name in urls}
    assert [written[name]["role"] for name in urls] == ["prefill", "decode", "decode"]
    assert written["inference_1"]["prefill_urls"] == [urls["prefill"]]
    assert tomllib.loads(paths["orchestrator"].read_text())["client"]["base_urls"] == list(urls.values())[1:]
    assert [name for name in _commands(config, paths) if name in urls] == list(urls)
    assert not _starts_together(config)
