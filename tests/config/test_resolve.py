"""`tandem rl`'s resolution: shared keys before validation, each derived rule, and every conflict an error."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from tandem.config.loader import ConfigError
from tandem.config.orchestrator import ProbeConfig
from tandem.config.dump import dump_process_configs
from tandem.config.resolve import DERIVED_RULES, SHARED_KEYS, parse_rl_args, process_configs
from tandem.transport.paths import CHECKPOINT_COMPLETE, checkpoint_dir


@dataclass
class FakeMachine:
    cuda_devices: int = 0
    port: int = 43210
    """The first free port it hands out; each later one is the next number (as a real machine, never twice)."""

    def num_cuda_devices(self) -> int:
        return self.cuda_devices

    def free_port(self) -> int:
        self.port += 1
        return self.port - 1


def resolve(*argv: str, machine: FakeMachine | None = None):
    return parse_rl_args(list(argv), environ={}, machine=machine or FakeMachine())


def test_shared_keys_reach_every_process():
    cfg = resolve("--model.name", "org/m", "--seq-len", "128", "--max-steps", "4", "--seed", "3", "--run.name", "r")
    for sub in (cfg.trainer, cfg.orchestrator, cfg.inference):
        assert (sub.model.name, sub.seq_len, sub.max_steps, sub.seed, sub.run.name) == ("org/m", 128, 4, 3, "r")
        assert sub.run_dir == Path("outputs/r")
    cfg = resolve("--trainer.model.dtype", "bfloat16")  # dtype is not shared: each process keeps its own
    assert cfg.trainer.model.dtype == "bfloat16" and cfg.inference.model.dtype == "auto"


def test_the_runs_model_dtype_and_remote_code_reach_every_process_when_set():
    """They were read and then dropped: `tandem rl --model.dtype bfloat16` ran every process in its default."""
    cfg = resolve("--model.dtype", "bfloat16", "--model.trust-remote-code")
    for sub in (cfg.trainer, cfg.orchestrator, cfg.inference):
        assert (sub.model.dtype, sub.model.trust_remote_code) == ("bfloat16", True)
    assert resolve("--model.dtype", "bfloat16", "--trainer.model.dtype", "bfloat16").inference.model.dtype == "bfloat16"
    with pytest.raises(ConfigError, match=r"`trainer.model.dtype` = 'float32' \(from the command line\) contradicts "
                                          r"`model.dtype` = 'bfloat16'"):
        resolve("--model.dtype", "bfloat16", "--trainer.model.dtype", "float32")


def test_the_load_format_is_shared_so_every_process_builds_the_same_random_weights():
    cfg = resolve("--model.load_format", "dummy")
    assert {sub.model.load_format for sub in (cfg.trainer, cfg.orchestrator, cfg.inference)} == {"dummy"}
    with pytest.raises(ConfigError, match=r"`inference.model.load_format` = 'safetensors' .* contradicts the shared"):
        resolve("--model.load_format", "dummy", "--inference.model.load_format", "safetensors")


def test_a_section_contradicting_a_shared_key_is_an_error_naming_both(tmp_path):
    f = tmp_path / "rl.toml"
    f.write_text("seq_len = 256\n[trainer]\nseq_len = 512\n")
    with pytest.raises(ConfigError, match=rf"`trainer.seq_len` = 512 \(from {f}\) contradicts the shared `seq_len`, "
                                          r"which makes it 256: set only the shared `seq_len`"):
        resolve("@", str(f))
    f.write_text("seq_len = 256\n[trainer]\nseq_len = 256\n")  # the same value twice is fine
    assert resolve("@", str(f)).trainer.seq_len == 256


def test_shared_keys_apply_before_the_processes_validate():
    # The trainer's own default seq_len (2048) would pass; the shared 3 must be what it checks.
    with pytest.raises(ConfigError, match=r"in `trainer`: `data.fake_samples_per_row` = 2 leaves fewer than 2 tokens .*"
                                          r"`trainer.seq_len` from the shared `seq_len`"):
        resolve("--seq-len", "3", "--trainer.data.fake", "true", "--trainer.data.fake_samples_per_row", "2")
    # ... and a combination that is only valid with the shared value passes.
    cfg = resolve("--seq-len", "4096", "--trainer.data.fake", "true", "--trainer.data.fake_samples_per_row", "1500")
    assert cfg.trainer.seq_len == 4096


def test_checkpoints_are_shared_by_trainer_and_orchestrator():
    cfg = resolve("--ckpt.enabled", "--ckpt.interval", "3")
    for sub in (cfg.trainer, cfg.orchestrator):
        assert sub.ckpt.enabled and sub.ckpt.interval == 3
    with pytest.raises(ConfigError, match=r"`orchestrator.ckpt.interval` = 5 \(from the command line\) contradicts the shared"):
        resolve("--ckpt.interval", "3", "--orchestrator.ckpt.interval", "5")


def test_the_preflights_probe_keys_reach_the_orchestrator_which_samples_the_probe():
    cfg = resolve("--preflight.num-conversations", "2", "--preflight.max-tokens", "8")
    assert (cfg.orchestrator.preflight.num_conversations, cfg.orchestrator.preflight.max_tokens) == (2, 8)
    assert resolve().orchestrator.preflight.model_dump() == ProbeConfig().model_dump()  # one source of defaults
    with pytest.raises(ConfigError, match=r"`orchestrator.preflight.max_tokens` = 4 \(from the command line\) contradicts the shared"):
        resolve("--preflight.max-tokens", "8", "--orchestrator.preflight.max-tokens", "4")


def test_trainer_ranks_follow_the_deployment():
    assert resolve("--deployment.num-trainer-processes", "2").orchestrator.num_trainer_ranks == 2
    cfg = resolve("--deployment.type", "gpu", "--deployment.trainer_devices", "[1, 2]", machine=FakeMachine(cuda_devices=3))
    assert cfg.orchestrator.num_trainer_ranks == 2
    with pytest.raises(ConfigError, match=r"`orchestrator.num_trainer_ranks` = 1 \(from the command line\) contradicts "
                                          r"`deployment.num_trainer_processes`, which makes it 2: remove `orchestrator.num_trainer_ranks`"):
        resolve("--deployment.num-trainer-processes", "2", "--orchestrator.num_trainer_ranks", "1")


def test_devices_follow_the_deployment_type():
    cfg = resolve()
    assert (cfg.trainer.device, cfg.inference.engine.device) == ("cpu", "cpu")
    cfg = resolve("--deployment.type", "gpu", machine=FakeMachine(cuda_devices=2))
    assert (cfg.trainer.device, cfg.inference.engine.device) == ("cuda", "cuda")
    assert cfg.inference.engine.memory_fraction == 0.9  # separate GPUs: the engine's own default
    with pytest.raises(ConfigError, match=r"`trainer.device` = 'cuda' \(from the command line\) contradicts "
                                          r"`deployment.type` = 'cpu', which makes it 'cpu'"):
        resolve("--trainer.device", "cuda")


def test_one_gpu_fails_at_once_unless_the_gpu_is_shared():
    one_gpu = FakeMachine(cuda_devices=1)
    with pytest.raises(ConfigError, match=r"`deployment.trainer_devices` = \[1\] names CUDA device\(s\) \[1\], but this "
                                          r"machine shows 1 CUDA device\(s\); to share GPU 0 .* `deployment.trainer_devices = \[0\]`"):
        resolve("--deployment.type", "gpu", machine=one_gpu)
    cfg = resolve("--deployment.type", "gpu", "--deployment.trainer_devices", "[0]", machine=one_gpu)
    assert cfg.inference.engine.memory_fraction == cfg.deployment.shared_gpu_memory_fraction == 0.4
    with pytest.raises(ConfigError, match=r"`inference.engine.memory_fraction` = 0.8 \(from the command line\) contradicts "
                                          r"`deployment.shared_gpu_memory_fraction`"):
        resolve("--deployment.type", "gpu", "--deployment.trainer_devices", "[0]",
                "--inference.engine.memory_fraction", "0.8", machine=one_gpu)


def test_the_orchestrator_talks_to_the_server_the_run_starts():
    cfg = resolve("--inference.server.port", "0", "--inference.server.api_key", "k", machine=FakeMachine(port=40001))
    assert cfg.inference.server.port == 40001 and cfg.deployment.inference_ports == [40001]
    assert cfg.orchestrator.client.base_urls == ["http://127.0.0.1:40001"] and cfg.orchestrator.client.api_key == "k"
    assert resolve().orchestrator.client.base_urls == ["http://127.0.0.1:8000"]
    with pytest.raises(ConfigError, match=r"`orchestrator.client.base_urls` = \['http://elsewhere:1'\] \(from the command "
                                          r"line\) contradicts `inference.server.host`, `inference.server.port` and "
                                          r"`deployment.num_inference_servers`"):
        resolve("--orchestrator.client.base_urls", '["http://elsewhere:1"]')


def test_each_inference_server_gets_its_port_and_the_orchestrator_all_urls():
    cfg = resolve("--deployment.num_inference_servers", "3", "--inference.server.port", "9100")
    assert cfg.deployment.inference_ports == [9100, 9101, 9102]
    assert cfg.orchestrator.client.base_urls == [f"http://127.0.0.1:{p}" for p in (9100, 9101, 9102)]
    servers = process_configs(cfg)
    assert list(servers) == ["inference", "inference_1", "inference_2", "orchestrator", "trainer"]
    assert [servers[n].server.port for n in ("inference", "inference_1", "inference_2")] == [9100, 9101, 9102]
    assert servers["inference_2"].model_copy(update={"server": cfg.inference.server}) == cfg.inference  # only the port differs
    cfg = resolve("--deployment.num_inference_servers", "2", "--inference.server.port", "0", machine=FakeMachine(port=41000))
    assert cfg.deployment.inference_ports == [41000, 41001] and cfg.inference.server.port == 41000
    with pytest.raises(ConfigError, match=r"`deployment.inference_ports` = \[1, 2\] \(from the command line\) contradicts "
                                          r"`inference.server.port` \+ i"):
        resolve("--deployment.num_inference_servers", "2", "--deployment.inference_ports", "[1, 2]")
    with pytest.raises(ConfigError, match=r"`inference.server.port` = 65535 leaves no port for 2 servers"):
        resolve("--deployment.num_inference_servers", "2", "--inference.server.port", "65535")


GPU_VLLM = ("--deployment.type", "gpu", "--inference.backend", "vllm", "--weight_transport.type", "broadcast")


def test_gpu_servers_take_consecutive_slices_of_the_inference_devices():
    five = FakeMachine(cuda_devices=5)
    cfg = resolve(*GPU_VLLM, "--deployment.num_inference_servers", "2", "--inference.vllm.tensor_parallel_size", "2",
                  "--deployment.inference_devices", "[0, 1, 2, 3]", "--deployment.trainer_devices", "[4]", machine=five)
    assert cfg.deployment.inference_device_slices == [[0, 1], [2, 3]]
    assert resolve("--deployment.num_inference_servers", "2").deployment.inference_device_slices == []  # cpu
    with pytest.raises(ConfigError, match=r"`deployment.inference_devices` = \[0\] lists 1 CUDA device\(s\), but "
                                          r"`deployment.num_inference_servers` = 2 server\(s\) of 1 device\(s\) need 2"):
        resolve("--deployment.type", "gpu", "--deployment.num_inference_servers", "2", machine=five)


def test_dry_run_shows_each_server_with_its_port_and_devices():
    cfg = resolve("--deployment.type", "gpu", "--deployment.num_inference_servers", "2", "--deployment.inference_devices",
                  "[0, 1]", "--deployment.trainer_devices", "[2]", "--inference.server.port", "9000",
                  machine=FakeMachine(cuda_devices=3))
    sections = {s.split(" ----")[0]: s.split("\n", 1)[1] for s in dump_process_configs(cfg).split("# ---- ")[1:]}
    assert list(sections) == ["inference", "inference_1", "orchestrator", "trainer"]
    assert sections["inference_1"].startswith("# runs on: CUDA device(s) [1]\n")
    assert tomllib.loads(sections["inference_1"])["server"]["port"] == 9001


def test_the_client_speaks_the_servers_backend():
    assert resolve().orchestrator.client.backend == "tandem"
    cfg = resolve(*GPU_VLLM, machine=FakeMachine(cuda_devices=2))
    assert cfg.orchestrator.client.backend == "vllm"
    with pytest.raises(ConfigError, match=r"`orchestrator.client.backend` = 'tandem' \(from the command line\) contradicts "
                                          r"`inference.backend` = 'vllm'"):
        resolve(*GPU_VLLM, "--orchestrator.client.backend", "tandem", machine=FakeMachine(cuda_devices=2))


def test_vllm_needs_gpus_and_serves_either_weight_transport():
    with pytest.raises(ConfigError, match=r"`inference.backend` = 'vllm' runs on CUDA only: set `deployment.type` = 'gpu'"):
        resolve("--inference.backend", "vllm", "--weight_transport.type", "broadcast")
    # One GPU shared by trainer and vLLM: the filesystem transport (vLLM reloads the folder; NCCL would need two GPUs).
    cfg = resolve("--deployment.type", "gpu", "--inference.backend", "vllm", "--deployment.trainer_devices", "[0]",
                  machine=FakeMachine(cuda_devices=1))
    assert (cfg.weight_transport.type, cfg.orchestrator.client.backend) == ("filesystem", "vllm")
    assert cfg.inference.engine.memory_fraction == cfg.deployment.shared_gpu_memory_fraction
    with pytest.raises(ConfigError, match=r"`orchestrator.sampling.return_routed_experts` = true needs `inference.backend` = 'tandem'"):
        resolve(*GPU_VLLM, "--orchestrator.sampling.return_routed_experts", "true", machine=FakeMachine(cuda_devices=2))


def test_the_weight_transport_is_shared_by_trainer_and_orchestrator(tmp_path):
    cfg = resolve()
    assert cfg.trainer.weight_transport.type == cfg.orchestrator.weight_transport.type == "filesystem"
    cfg = resolve("--weight_transport.type", "broadcast", "--weight_transport.bucket_mib", "8")
    assert cfg.trainer.weight_transport == cfg.orchestrator.weight_transport == cfg.weight_transport
    assert cfg.trainer.weight_transport.bucket_mib == 8
    with pytest.raises(ConfigError, match=r"`trainer.weight_transport` = .* contradicts the shared `weight_transport`"):
        resolve("--trainer.weight_transport.type", "broadcast")


def test_the_broadcast_group_is_derived_from_the_servers():
    cfg = resolve("--weight_transport.type", "broadcast", "--deployment.num_inference_servers", "2",
                  "--inference.server.port", "9000", machine=FakeMachine(port=42000))
    for transport in (cfg.weight_transport, cfg.trainer.weight_transport, cfg.orchestrator.weight_transport):
        assert (transport.num_inference_ranks, transport.world_size, transport.port, transport.receiver) == (2, 3, 42000, "tandem")
    cfg = resolve(*GPU_VLLM, "--inference.vllm.tensor_parallel_size", "2", "--deployment.inference_devices", "[0, 1]",
                  "--deployment.trainer_devices", "[2]", "--weight_transport.port", "29500", machine=FakeMachine(cuda_devices=3))
    assert (cfg.trainer.weight_transport.num_inference_ranks, cfg.trainer.weight_transport.port,
            cfg.orchestrator.weight_transport.receiver) == (2, 29500, "vllm")
    with pytest.raises(ConfigError, match=r"`weight_transport.num_inference_ranks` = 3 \(from the command line\) contradicts "
                                          r"`deployment.num_inference_servers` \(on each inference node\) x the ranks of one server, which makes it 2"):
        resolve("--weight_transport.type", "broadcast", "--deployment.num_inference_servers", "2",
                "--weight_transport.num_inference_ranks", "3")
    with pytest.raises(ConfigError, match=r"`weight_transport.receiver` = 'vllm' \(from the command line\) contradicts "
                                          r"`inference.backend`, which makes it 'tandem'"):
        resolve("--weight_transport.type", "broadcast", "--weight_transport.receiver", "vllm")


def test_the_trainer_quantizes_the_broadcast_for_an_fp8_engine_only():
    """The trainer learns the engine's scheme from the resolved config: tandem's FP8 engine takes its projections
    quantized (its routed experts too with `inference.engine.fp8_experts`); a bf16 engine, and vLLM (which quantizes
    on its own load), take `model.dtype`."""
    cfg = resolve("--weight_transport.type", "broadcast", "--inference.engine.quantization", "fp8")
    assert cfg.trainer.weight_transport.quantization == cfg.orchestrator.weight_transport.quantization == "fp8"
    assert cfg.trainer.weight_transport.fp8_experts  # the engine's default: experts in FP8 too
    cfg = resolve("--weight_transport.type", "broadcast", "--inference.engine.quantization", "fp8",
                  "--inference.engine.fp8_experts", "false")
    assert not cfg.trainer.weight_transport.fp8_experts and cfg.trainer.weight_transport.quantization == "fp8"
    assert resolve("--weight_transport.type", "broadcast").trainer.weight_transport.quantization == "none"
    cfg = resolve(*GPU_VLLM, "--inference.engine.quantization", "fp8",
                  "--deployment.trainer_devices", "[1]", machine=FakeMachine(cuda_devices=2))
    assert cfg.trainer.weight_transport.quantization == "none"
    with pytest.raises(ConfigError, match=r"`weight_transport.quantization` = 'fp8' \(from the command line\) contradicts "
                                          r"`inference.engine.quantization`"):
        resolve("--weight_transport.type", "broadcast", "--weight_transport.quantization", "fp8")


def test_broadcast_refuses_a_gpu_shared_by_trainer_and_server():
    with pytest.raises(ConfigError, match=r"`weight_transport.type` = 'broadcast' needs `deployment.trainer_devices` = \[0\] "
                                          r"apart from `deployment.inference_devices` = \[0\]"):
        resolve("--deployment.type", "gpu", "--deployment.trainer_devices", "[0]", "--weight_transport.type", "broadcast",
                machine=FakeMachine(cuda_devices=1))


def test_a_lora_run_on_vllm_loads_adapter_folders_and_refuses_the_broadcast():
    cfg = resolve(*GPU_VLLM, "--deployment.trainer_devices", "[1]", "--trainer.lora.enabled", "true",
                  "--weight_transport.type", "filesystem", machine=FakeMachine(cuda_devices=2))
    assert cfg.inference.engine.lora.enabled and cfg.inference.base_served_name == f"{cfg.model.name}-base"
    with pytest.raises(ConfigError, match=r"'broadcast' with `trainer.lora` and `inference.backend` = 'vllm'"):
        resolve(*GPU_VLLM, "--deployment.trainer_devices", "[1]", "--trainer.lora.enabled", "true",
                "--weight_transport.type", "broadcast", machine=FakeMachine(cuda_devices=2))
    with pytest.raises(ConfigError, match=r"in `inference`: `engine.lora.target_experts` = \['down_proj'\] with "
                                        r"`backend` = 'vllm'.*from `trainer.lora`"):
        resolve(*GPU_VLLM, "--deployment.trainer_devices", "[1]", "--trainer.lora.enabled", "true",
                "--trainer.lora.target-experts", '["down_proj"]', "--weight_transport.type", "filesystem",
                machine=FakeMachine(cuda_devices=2))


def checkpoint(run_dir: Path, step: int, process: str) -> None:
    folder = checkpoint_dir(run_dir, step, process)
    folder.mkdir(parents=True)
    (folder / CHECKPOINT_COMPLETE[process]).touch()


def test_resume_continues_both_processes_from_the_newest_step_both_checkpointed(tmp_path):
    cfg = resolve("--resume", "--output-dir", str(tmp_path))  # nothing to resume yet: each starts at step 1
    assert cfg.trainer.ckpt.resume and cfg.orchestrator.ckpt.resume and cfg.trainer.ckpt.resume_step is None
    for step in (2, 4):
        checkpoint(tmp_path, step, "orchestrator")
    for step in (2, 4, 5):  # the trainer checkpoints its last step too; the orchestrator was stopped before 5
        checkpoint(tmp_path, step, "trainer")
    (checkpoint_dir(tmp_path, 6, "orchestrator")).mkdir(parents=True)  # incomplete on both sides
    cfg = resolve("--resume", "--output-dir", str(tmp_path))
    assert cfg.trainer.ckpt.resume_step == cfg.orchestrator.ckpt.resume_step == 4
    assert resolve("--output-dir", str(tmp_path)).trainer.ckpt.resume_step is None
    with pytest.raises(ConfigError, match=r"`trainer.ckpt.resume` = True \(from the command line\) contradicts `resume`"):
        resolve("--trainer.ckpt.resume")
    with pytest.raises(ConfigError, match=r"`trainer.ckpt.resume_step` = 2 \(from the command line\) contradicts `resume` "
                                          r"\(the newest step both checkpointed\), which makes it 4"):
        resolve("--resume", "--output-dir", str(tmp_path), "--trainer.ckpt.resume_step", "2")


def test_resume_refuses_checkpoints_of_only_one_process(tmp_path):
    checkpoint(tmp_path, 3, "trainer")
    with pytest.raises(ConfigError, match=r"holds no step that both processes checkpointed \(orchestrator: \[\], trainer: \[3\]\)"):
        resolve("--resume", "--output-dir", str(tmp_path))


def test_exact_is_one_switch_and_refuses_what_cannot_honour_it(tmp_path):
    cfg = resolve("--run.exact", "true")
    assert cfg.trainer.run.exact and cfg.inference.run.exact and cfg.orchestrator.run.exact
    with pytest.raises(ConfigError, match=r"`inference.run.exact` = False .* contradicts the shared"):
        resolve("--run.exact", "true", "--inference.run.exact", "false")
    with pytest.raises(ConfigError, match=r"`inference.backend` = \"tandem\", not 'vllm'"):
        resolve("--run.exact", "true", "--inference.backend", "vllm")
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ConfigError, match="model_type 'llama', which falls back to transformers"):
        resolve("--run.exact", "true", "--model.name", str(tmp_path))
    for model_type in ("qwen3", "glm_moe_dsa", "deepseek_v3"):  # decoder blocks and latent attention blocks
        (tmp_path / "config.json").write_text(f'{{"model_type": "{model_type}"}}')
        assert resolve("--run.exact", "true", "--model.name", str(tmp_path)).trainer.run.exact
    with pytest.raises(ConfigError, match=r"'vllm' runs on CUDA only"):  # exact off: only the backend's own rule speaks
        resolve("--inference.backend", "vllm")
    with pytest.raises(ConfigError, match=r"`run.exact` = true cannot split rows over ranks: `trainer.parallel.cp` = 2"):
        resolve("--run.exact", "true", "--trainer.parallel.cp", "2", "--deployment.num-trainer-processes", "2")


def test_the_starting_model_is_a_folder_a_hub_name_or_the_warm_ups_result(tmp_path):
    (tmp_path / "model").mkdir()
    assert resolve("--model.name", str(tmp_path / "model")).model.name == str(tmp_path / "model")
    assert resolve("--model.name", "Qwen/Qwen3-0.6B").model.name == "Qwen/Qwen3-0.6B"  # fetched later, by the processes
    for name in (str(tmp_path / "typo"), "./org/model", "org/team/model"):
        with pytest.raises(ConfigError, match=r"`model.name` = .* is no folder and no hub name"):
            resolve("--model.name", name)
    assert resolve("--model.name", str(tmp_path / "typo"), "--deployment.launcher", "slurm",  # each node checks at its start
                   "--deployment.cluster.num-nodes", "2", "--inference.server.port", "8100").model.name
    sft = tmp_path / "sft.toml"
    sft.write_text(f'output_dir = "{tmp_path / "sft"}"\nmax_steps = 30\n[data]\npath = "d.jsonl"\n')
    for written in ("final", "step_30"):
        assert resolve("--model.name", str(tmp_path / "sft" / "weights" / written), "--warmup.sft", str(sft)).warmup.sft == sft
    with pytest.raises(ConfigError, match=r"does not exist, and the warm-up `warmup.sft` = .* does not write it: its result is "
                                          r".*/sft/weights/final"):
        resolve("--model.name", str(tmp_path / "sft" / "weights" / "finall"), "--warmup.sft", str(sft))
    with pytest.raises(ConfigError, match=r"a run of several nodes .* does not run the warm-up"):
        resolve("--model.name", str(tmp_path / "sft" / "weights" / "final"), "--warmup.sft", str(sft), *TWO_NODES)
    with pytest.raises(ConfigError, match=r"`warmup.sft` = .*missing.toml': config file not found"):
        resolve("--model.name", str(tmp_path / "sft" / "weights" / "final"), "--warmup.sft", str(tmp_path / "missing.toml"))


def test_lora_reaches_the_engine_whole_and_a_contradiction_is_named():
    cfg = resolve("--trainer.lora.enabled", "true", "--trainer.lora.rank", "8", "--trainer.lora.target-modules", '["q_proj"]')
    engine = cfg.inference.engine.lora
    assert (engine.enabled, engine.rank, engine.alpha, engine.target_modules) == (True, 8, 32.0, ["q_proj"])
    assert cfg.trainer.lora == engine
    assert not resolve().inference.engine.lora.enabled
    with pytest.raises(ConfigError, match=r"`inference.engine.lora.rank` = 4 .* contradicts"):
        resolve("--trainer.lora.enabled", "true", "--inference.engine.lora.rank", "4")
    with pytest.raises(ConfigError, match="adapters are merged into the base's weights in `model.dtype`"):
        resolve("--trainer.lora.enabled", "true", "--inference.engine.quantization", "fp8")


SHARE = ("--trainer.lora.enabled", "true", "--trainer.lora.share_base", "true", "--preflight.enabled", "false")
ONE_GPU = ("--deployment.type", "gpu", "--deployment.trainer_devices", "[0]", "--deployment.inference_devices", "[0]")


def test_a_shared_base_reaches_the_engine_and_is_refused_where_it_cannot_hold():
    cfg = resolve(*SHARE, *ONE_GPU, machine=FakeMachine(cuda_devices=1))
    assert cfg.inference.engine.lora.share_base and cfg.trainer.lora.share_base
    assert resolve(*SHARE).inference.engine.lora.share_base  # the CPU: one trainer process beside the server
    refused = [
        (["--preflight.enabled", "true"], r"`preflight.enabled` = true"),
        (["--deployment.type", "gpu", "--deployment.trainer_devices", "[1]"], r"`deployment.trainer_devices` = \[1\]"),
        (["--deployment.num_trainer_processes", "2"], r"`deployment.num_trainer_processes` = 2"),
        (["--trainer.parallel.fsdp_at_one_rank", "true"], r"`trainer.parallel.fsdp_at_one_rank` = true"),
    ]
    for extra, reason in refused:
        with pytest.raises(ConfigError, match=r"`trainer.lora.share_base` = true with " + reason):
            resolve(*SHARE, *extra, machine=FakeMachine(cuda_devices=2))
    with pytest.raises(ConfigError, match=r"`lora.share_base` = true needs `lora.enabled` = true"):
        resolve("--trainer.lora.share_base", "true")
    with pytest.raises(ConfigError, match=r"`trainer.lora.share_base` = true with `inference.backend` = 'vllm'"):
        resolve(*SHARE, *GPU_VLLM, "--deployment.trainer_devices", "[0]", "--deployment.inference_devices", "[0]",
                "--weight_transport.type", "filesystem", machine=FakeMachine(cuda_devices=1))
    with pytest.raises(ConfigError, match=r"in `inference`: `engine.lora.share_base` with `run.exact`"):
        resolve(*SHARE, "--run.exact", "true")


def test_every_rule_and_shared_key_is_exercised_above():
    # A new rule or shared key must come with its own test in this file: this list is the reminder.
    assert [r.__name__ for r in DERIVED_RULES] == ["model_options", "nodes", "trainer_ranks", "devices", "inference_servers",
                                                   "inference_device_slices", "starting_model", "exact", "backend",
                                                   "weight_broadcast", "lora", "shared_base", "resume",
                                                   "disaggregation"]
    assert set(SHARED_KEYS) == {"model.name", "model.load_format", "run.name", "run.exact", "seq_len", "max_steps",
                                "output_dir", "seed", "ckpt.enabled", "ckpt.interval", "weight_transport",
                                "preflight.num_conversations", "preflight.max_tokens"}


PD = ("--deployment.num_prefill_servers", "1", "--deployment.num_decode_servers", "2", "--inference.server.port", "9200")


def test_disaggregated_pools_get_their_roles_and_the_orchestrator_only_decode_servers():
    cfg = resolve(*PD)
    assert cfg.deployment.inference_ports == [9200, 9201, 9202]
    assert cfg.orchestrator.client.base_urls == ["http://127.0.0.1:9201", "http://127.0.0.1:9202"]
    servers = process_configs(cfg)
    assert list(servers) == ["prefill", "inference", "inference_1", "orchestrator", "trainer"]
    roles = {name: servers[name].disaggregation for name in ("prefill", "inference", "inference_1")}
    assert [d.role for d in roles.values()] == ["prefill", "decode", "decode"]
    assert roles["inference"].prefill_urls == roles["inference_1"].prefill_urls == ["http://127.0.0.1:9200"]
    # One decode server passes the updates on to each prefill server.
    assert (roles["inference"].forward_updates_to, roles["inference_1"].forward_updates_to) == (["http://127.0.0.1:9200"], [])
    assert servers["prefill"].server.port == 9200
    assert resolve().inference.disaggregation.role == "colocated"  # off by default


def test_disaggregation_config_errors_name_the_key_and_the_file(tmp_path):
    f = tmp_path / "rl.toml"
    f.write_text("[deployment]\nnum_prefill_servers = 2\n")
    with pytest.raises(ConfigError, match=rf"`num_decode_servers` = 0 leaves a pool empty while `num_prefill_servers` = 2"
                                          rf".*`deployment.num_prefill_servers` from {f}"):
        resolve("@", str(f))
    f.write_text("[deployment]\nnum_prefill_servers = 1\nnum_decode_servers = 1\ntype = 'gpu'\n"
                 "inference_devices = [0]\ntrainer_devices = [1]\n")
    with pytest.raises(ConfigError, match=rf"= 2 servers but `inference_devices` = \[0\] lists 1 GPU.*"
                                          rf"set `disaggregated_memory_fraction`.*`deployment.num_prefill_servers` from {f}"):
        resolve("@", str(f), machine=FakeMachine(cuda_devices=2))
    cfg = resolve("@", str(f), "--deployment.disaggregated_memory_fraction", "0.45", machine=FakeMachine(cuda_devices=2))
    assert cfg.deployment.inference_device_slices == [[0], [0]] and cfg.inference.engine.memory_fraction == 0.45
    # The decode server starts second on GPU 0, which then already holds the prefill server's share.
    engines = {name: c.engine.memory_fraction for name, c in process_configs(cfg).items() if name in ("prefill", "inference")}
    assert engines == {"prefill": 0.45, "inference": 0.9}
    with pytest.raises(ConfigError, match=r"`disaggregated_memory_fraction` = 0.6 x 2 servers on one of "
                                          rf"`inference_devices` = \[0\] is more than the whole GPU.*from {f}"):
        resolve("@", str(f), "--deployment.disaggregated_memory_fraction", "0.6", machine=FakeMachine(cuda_devices=2))
    with pytest.raises(ConfigError, match=r"`inference.disaggregation.kv_transport` = 'torch_distributed' with a "
                                          r"prefill and a decode server on one GPU"):
        resolve("@", str(f), "--deployment.disaggregated_memory_fraction", "0.45",
                "--inference.disaggregation.kv_transport", "torch_distributed", machine=FakeMachine(cuda_devices=2))
    cfg = resolve("@", str(f), "--deployment.disaggregated_memory_fraction", "0.45", "--deployment.inference_devices",
                  "[0, 1]", "--deployment.trainer_devices", "[2]", "--inference.disaggregation.kv_transport",
                  "torch_distributed", machine=FakeMachine(cuda_devices=3))
    assert cfg.deployment.inference_device_slices == [[0], [1]]  # a GPU each: NCCL pairs them
    with pytest.raises(ConfigError, match=r"`num_inference_servers` = 2 counts colocated servers"):
        resolve(*PD, "--deployment.num_inference_servers", "2")
    with pytest.raises(ConfigError, match=r"`weight_transport.type` = 'broadcast' with `deployment.num_prefill_servers`"):
        resolve(*PD, "--weight_transport.type", "broadcast")
    with pytest.raises(ConfigError, match=r"`inference.disaggregation.role` is decided for each server"):
        resolve(*PD, "--inference.disaggregation.role", "decode", "--inference.disaggregation.prefill_urls", '["http://x"]')
    with pytest.raises(ConfigError, match=r"`deployment.num_prefill_servers` needs `inference.backend` = 'tandem'"):
        resolve(*PD, "--deployment.type", "gpu", "--deployment.inference_devices", "[0, 1, 2]",
                "--deployment.trainer_devices", "[3]", "--inference.backend", "vllm", machine=FakeMachine(cuda_devices=4))


TWO_NODES = ("--deployment.cluster.num-nodes", "2", "--deployment.cluster.hosts", '["a.cluster", "b.cluster"]',
             "--inference.server.port", "8100")


def test_nodes_get_their_hosts_and_servers_listen_for_other_nodes():
    cfg = resolve(*TWO_NODES)
    assert cfg.deployment.cluster.hosts == ["a.cluster", "b.cluster"] and cfg.inference.server.host == "0.0.0.0"
    assert resolve(*TWO_NODES[:2], "--deployment.cluster.hosts", '["127.0.0.1", "localhost"]', *TWO_NODES[4:]).inference.server.host == "127.0.0.1"
    with pytest.raises(ConfigError, match=r"`deployment.cluster.num_nodes` = 2 needs `deployment.cluster.hosts`"):
        resolve(*TWO_NODES[:2], *TWO_NODES[4:])
    with pytest.raises(ConfigError, match=r"in `deployment.cluster`: `hosts` lists 1 address\(es\) but `num_nodes` = 2"):
        resolve(*TWO_NODES[:2], "--deployment.cluster.hosts", '["a"]', *TWO_NODES[4:])
    with pytest.raises(ConfigError, match=r"nodes 1 .. 1 would run nothing"):
        resolve("--deployment.cluster.num-nodes", "3", "--deployment.cluster.hosts", '["a", "b", "c"]')
    with pytest.raises(ConfigError, match=r"`inference.server.host` = '10.0.0.1' \(from the command line\) contradicts"):
        resolve(*TWO_NODES, "--inference.server.host", "10.0.0.1")


def test_slurm_and_k8s_decide_the_hosts():
    slurm = resolve(*TWO_NODES[:2], *TWO_NODES[4:], "--deployment.launcher", "slurm")
    assert slurm.deployment.cluster.hosts == ["slurm-node-0", "slurm-node-1"]
    k8s = resolve("--deployment.cluster.num-nodes", "3", "--deployment.cluster.num-trainer-nodes", "2", "--run.name", "My_Run",
                  "--deployment.launcher", "k8s", "--deployment.type", "gpu", "--deployment.trainer-devices", "[0, 1, 2, 3]")
    assert k8s.deployment.cluster.hosts == ["my-run-trainer-0.my-run-trainer", "my-run-trainer-1.my-run-trainer",
                                            "my-run-inference-0.my-run-inference"]
    # the render machine has no GPU: each pod checks its own
    assert k8s.orchestrator.client.base_urls == ["http://my-run-inference-0.my-run-inference:8000"]
    for nodes in (("2", "2"), ("1", "1")):  # one node cannot hold a trainer pod and a server pod
        with pytest.raises(ConfigError, match=r"runs each node's role in its own pods: set `deployment.cluster.num_nodes` = "):
            resolve("--deployment.cluster.num-nodes", nodes[0], "--deployment.cluster.num-trainer-nodes", nodes[1],
                    "--deployment.launcher", "k8s")


def test_the_orchestrator_talks_to_every_inference_node_and_the_trainer_spans_its_nodes():
    cfg = resolve("--deployment.cluster.num-nodes", "4", "--deployment.cluster.hosts", '["n0", "n1", "n2", "n3"]',
                  "--deployment.cluster.num-trainer-nodes", "2", "--deployment.cluster.num-inference-nodes", "2",
                  "--deployment.num-trainer-processes", "3", "--inference.server.port", "8100")
    assert cfg.orchestrator.client.base_urls == ["http://n2:8100", "http://n3:8100"]
    assert cfg.orchestrator.num_trainer_ranks == 6
    assert [cfg.deployment.cluster.roles(i) for i in range(4)] == [["trainer"], ["trainer"], ["inference"], ["inference", "orchestrator"]]
    with pytest.raises(ConfigError, match=r"`inference.server.port` = 0 \(a free port\) cannot be agreed on by several nodes"):
        resolve(*TWO_NODES[:4], "--inference.server.port", "0")


def test_several_servers_on_each_of_several_inference_nodes():
    cfg = resolve("--deployment.cluster.num-nodes", "3", "--deployment.cluster.hosts", '["n0", "n1", "n2"]',
                  "--deployment.cluster.num-inference-nodes", "2", "--deployment.num-inference-servers", "2",
                  "--inference.server.port", "8100")
    assert cfg.deployment.inference_ports == [8100, 8101]
    assert cfg.orchestrator.client.base_urls == ["http://n1:8100", "http://n1:8101", "http://n2:8100", "http://n2:8101"]
    assert list(process_configs(cfg)) == ["orchestrator", "trainer"]  # node 0 runs no server
    on_node_1 = resolve("--deployment.cluster.num-nodes", "3", "--deployment.cluster.hosts", '["n0", "n1", "n2"]',
                        "--deployment.cluster.num-inference-nodes", "2", "--deployment.num-inference-servers", "2",
                        "--inference.server.port", "8100", "--deployment.cluster.node-rank", "1")
    assert list(process_configs(on_node_1)) == ["inference", "inference_1", "orchestrator", "trainer"]
    with pytest.raises(ConfigError, match=r"'k8s' runs one inference server per pod: set `deployment.num_inference_servers` = 1"):
        resolve("--deployment.cluster.num-nodes", "2", "--deployment.launcher", "k8s", "--deployment.num-inference-servers", "2")


def test_broadcast_over_several_nodes_meets_at_node_0():
    cfg = resolve(*TWO_NODES, "--deployment.num-inference-servers", "2", "--weight-transport.type", "broadcast",
                  "--weight-transport.port", "29600")
    for transport in (cfg.weight_transport, cfg.trainer.weight_transport, cfg.orchestrator.weight_transport):
        assert (transport.host, transport.port, transport.num_inference_ranks) == ("a.cluster", 29600, 2)
    with pytest.raises(ConfigError, match=r"`weight_transport.port` = 0 \(a free port\) cannot be agreed on by several nodes"):
        resolve(*TWO_NODES, "--weight-transport.type", "broadcast")


def test_a_value_where_a_section_belongs_is_a_config_error():
    with pytest.raises(ConfigError, match=r"invalid value for `trainer` \(from the command line\): 5"):
        resolve("--trainer", "5")


def test_resolution_is_pure():
    args = ("--inference.server.port", "0", "--deployment.num-trainer-processes", "2")
    assert resolve(*args) == resolve(*args)


def test_a_context_parallel_size_that_does_not_divide_the_trainer_ranks_fails_before_any_process_starts():
    assert resolve("--deployment.num-trainer-processes", "4", "--trainer.parallel.cp", "2").trainer.parallel.cp == 2
    with pytest.raises(ConfigError, match=r"`trainer.parallel.cp` = 2 must divide the trainer's ranks, "
                                          r"`deployment.num_trainer_processes` = 3"):
        resolve("--deployment.num-trainer-processes", "3", "--trainer.parallel.cp", "2")
    with pytest.raises(ConfigError, match=r"`trainer.parallel.cp` = 4 must divide the trainer's ranks, "
                                          r"`len\(deployment.trainer_devices\)` = 2"):
        resolve("--deployment.type", "gpu", "--deployment.trainer_devices", "[1, 2]", "--trainer.parallel.cp", "4",
                machine=FakeMachine(cuda_devices=3))
