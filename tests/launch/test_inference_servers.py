"""What `tandem rl` derives for its inference servers and the broadcast weight transport."""

from __future__ import annotations

import pytest

from tandem.config.rl import RLConfig
from tandem.launch.rl import (RunFailed, _commands, _write_process_configs, inference_device_slices,
                              resolve_backend, resolve_inference_servers, resolve_weight_transport)


def rl_config(tmp_path, **values) -> RLConfig:
    return RLConfig.model_validate({"output_dir": str(tmp_path), **values})


def test_two_cpu_servers_get_distinct_free_ports_configs_and_commands(tmp_path):
    config = rl_config(tmp_path, deployment={"num_inference_servers": 2}, inference={"server": {"port": 0}})
    (tmp_path / "configs").mkdir()
    paths = _write_process_configs(config)
    urls = config.orchestrator.client.base_urls
    assert len(urls) == 2 and len(set(urls)) == 2
    ports = [int(url.rsplit(":", 1)[1]) for url in urls]
    assert f"port = {ports[0]}" in paths["inference"].read_text()
    assert f"port = {ports[1]}" in paths["inference_1"].read_text()
    commands = _commands(config, paths)
    assert [name for name in commands if name.startswith("inference")] == ["inference", "inference_1"]
    assert commands["inference_1"][0][-1] == str(paths["inference_1"])


def test_fixed_port_counts_up_and_user_urls_must_agree(tmp_path):
    config = rl_config(tmp_path, deployment={"num_inference_servers": 3}, inference={"server": {"port": 9100}})
    assert resolve_inference_servers(config) == [9100, 9101, 9102]
    clash = rl_config(tmp_path, deployment={"num_inference_servers": 2},
                      orchestrator={"client": {"base_urls": ["http://127.0.0.1:9100"]}})
    with pytest.raises(RunFailed, match="orchestrator.client.base_urls"):
        resolve_inference_servers(clash)


def test_broadcast_group_is_derived_from_the_servers(tmp_path):
    config = rl_config(tmp_path, deployment={"num_inference_servers": 2}, weight_transport={"type": "broadcast"})
    resolve_weight_transport(config)
    for transport in (config.weight_transport, config.trainer.weight_transport, config.orchestrator.weight_transport):
        assert transport.num_inference_ranks == 2 and transport.world_size == 3 and transport.port > 0
    assert config.trainer.weight_transport.port == config.orchestrator.weight_transport.port

    user_set = rl_config(tmp_path, deployment={"num_inference_servers": 2},
                         weight_transport={"type": "broadcast", "num_inference_ranks": 3})
    with pytest.raises(RunFailed, match="num_inference_ranks` = 3 contradicts the 2"):
        resolve_weight_transport(user_set)


def test_broadcast_refuses_a_shared_gpu(tmp_path):
    config = rl_config(tmp_path, deployment={"type": "gpu", "inference_devices": [0], "trainer_devices": [0]},
                       weight_transport={"type": "broadcast"})
    with pytest.raises(RunFailed, match="trainer_devices` apart"):
        resolve_weight_transport(config)


def test_gpu_servers_take_consecutive_device_slices(tmp_path):
    config = rl_config(tmp_path, deployment={"type": "gpu", "num_inference_servers": 2, "inference_devices": [0, 1, 2, 3],
                                             "trainer_devices": [4]},
                       inference={"backend": "vllm", "vllm": {"tensor_parallel_size": 2}})
    assert inference_device_slices(config) == [[0, 1], [2, 3]]
    short = rl_config(tmp_path, deployment={"type": "gpu", "num_inference_servers": 2, "inference_devices": [0]})
    with pytest.raises(RunFailed, match="lists 1 GPU"):
        inference_device_slices(short)


def test_vllm_servers_set_the_client_and_need_gpus_and_broadcast(tmp_path):
    gpu = {"type": "gpu", "inference_devices": [0], "trainer_devices": [1]}
    config = rl_config(tmp_path, deployment=gpu, inference={"backend": "vllm"}, weight_transport={"type": "broadcast"})
    resolve_backend(config)
    assert config.orchestrator.client.backend == "vllm" and config.trainer.weight_transport.receiver == "vllm"
    with pytest.raises(RunFailed, match="CUDA only"):
        resolve_backend(rl_config(tmp_path, inference={"backend": "vllm"}, weight_transport={"type": "broadcast"}))
    with pytest.raises(RunFailed, match="set `weight_transport.type` = \"broadcast\""):
        resolve_backend(rl_config(tmp_path, deployment=gpu, inference={"backend": "vllm"}))
    with pytest.raises(RunFailed, match="orchestrator.client.backend"):
        resolve_backend(rl_config(tmp_path, deployment=gpu, inference={"backend": "vllm"}, weight_transport={"type": "broadcast"},
                                  orchestrator={"client": {"backend": "tandem"}}))
