"""The vLLM backend without vLLM: its argument mapping, its errors, and the wiring of
`tandem inference --backend vllm` around a stand-in `vllm` executable (`fake_vllm/vllm`).
The test against a real vLLM skips where none is installed."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgspec
import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import save_file

from tandem.config.inference import InferenceConfig
from tandem.config.lora import LoraConfig
from tandem.config.orchestrator import ClientConfig, OrchestratorConfig
from tandem.config.resolve import free_port
from tandem.config.vllm import TANDEM_SET_FLAGS
from tandem.inference.vllm.args import check_extra_args, flags_in_help, mapped_flags, serve_argv, serve_env
from tandem.inference.vllm.server import main as vllm_main
from tandem.inference.vllm.server import serves_fp8_checkpoint
from tandem.models.byte_tokenizer import build_byte_tokenizer
from tandem.models.hub import read_hf_config
from tandem.models.loading import build_native
from tandem.models.lora import LoraSpec, apply_lora, initial_adapters, read_adapter_folder, write_adapter_folder
from tandem.orchestrator.inference_pool import InferencePool
from tandem.orchestrator.preflight import sample_conversation
from tandem.orchestrator.server_dialect import VllmDialect
from tandem.transport.broadcast_types import update_info_of

FAKE = Path(__file__).with_name("fake_vllm")
REPO = Path(__file__).resolve().parents[2]
SYSTEM_PATH = ["/usr/bin", "/bin"]
"""What stays on PATH besides the stand-in: a vllm installed beside the interpreter must not answer."""


def vllm_config(**values) -> InferenceConfig:
    return InferenceConfig.model_validate({"backend": "vllm", "model": {"name": "/models/qwen3"}, **values})


def test_tandem_keys_map_onto_vllm_flags():
    config = vllm_config(seed=5, model={"name": "/models/qwen3", "dtype": "auto"},
                         engine={"memory_fraction": 0.4, "max_model_len": 2048, "max_num_seqs": 32},
                         server={"port": 8123, "api_key": "k"},
                         vllm={"tensor_parallel_size": 2, "enable_prefix_caching": False,
                               "extra_args": {"max_num_batched_tokens": 8192, "enforce_eager": True}})
    argv = serve_argv(config)
    assert argv[0] == "/models/qwen3"
    pairs = {flag: value for flag, value in zip(argv[1:], argv[2:]) if flag.startswith("--") and not value.startswith("--")}
    assert pairs["--served-model-name"] == "/models/qwen3" and pairs["--dtype"] == "bfloat16"
    assert pairs["--gpu-memory-utilization"] == "0.4" and pairs["--max-model-len"] == "2048"
    assert pairs["--max-num-seqs"] == "32" and pairs["--seed"] == "5" and pairs["--port"] == "8123"
    assert pairs["--tensor-parallel-size"] == "2"
    assert "--api-key" not in argv and serve_env(config)["VLLM_API_KEY"] == "k"  # a command line is public (`ps`)
    assert json.loads(pairs["--weight-transfer-config"]) == {"backend": "nccl"}
    assert pairs["--logprobs-mode"] == "processed_logprobs"  # log_softmax(logits / T), as tandem's engine reports
    assert "--no-enable-prefix-caching" in argv and "--no-trust-remote-code" in argv
    assert "--disable-uvicorn-access-log" in argv  # `server.access_log` = false: no line per request
    assert argv[argv.index("--max-num-batched-tokens") + 1] == "8192" and "--enforce-eager" in argv
    lora = vllm_config(engine={"lora": {"enabled": True}, "speculative": {"method": "ngram"}})
    fp8 = vllm_config(engine={"quantization": "fp8"})
    # every flag tandem sets, in a LoRA, speculative or FP8 run or not, is refused as a pass-through
    assert {*mapped_flags(config), *mapped_flags(lora, "/tmp/start"), *mapped_flags(fp8), "api_key"} == TANDEM_SET_FLAGS


@pytest.mark.parametrize("speculative, vllm_fields", [
    ({"method": "ngram", "num_tokens": 3, "ngram_max": 5},
     {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, "prompt_lookup_min": 1}),
    ({"method": "draft_model", "draft_model": "/models/small", "draft_sampling": "sampled"},
     {"method": "draft_model", "model": "/models/small", "num_speculative_tokens": 4, "draft_sample_method": "probabilistic"}),
    ({"method": "draft_model", "draft_model": "/models/small"},
     {"method": "draft_model", "model": "/models/small", "num_speculative_tokens": 4, "draft_sample_method": "greedy"}),
    ({"method": "mtp", "num_tokens": 2},
     {"method": "mtp", "num_speculative_tokens": 2, "draft_sample_method": "greedy"}),
])
def test_speculative_decoding_maps_onto_vllms_speculative_config(speculative, vllm_fields):
    argv = serve_argv(vllm_config(engine={"speculative": speculative}))
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == vllm_fields
    assert "--speculative-config" not in serve_argv(vllm_config())


def test_a_lora_run_serves_the_base_and_the_policy_as_a_vllm_adapter():
    config = vllm_config(engine={"lora": {"enabled": True, "rank": 12}})
    argv = serve_argv(config, "/tmp/start")
    assert argv[0] == "/models/qwen3" and argv[argv.index("--served-model-name") + 1] == "/models/qwen3-base"
    assert "--enable-lora" in argv and argv[argv.index("--max-loras") + 1] == "1"
    assert argv[argv.index("--max-lora-rank") + 1] == "16"  # the smallest rank vLLM takes that holds 12
    assert json.loads(argv[argv.index("--lora-modules") + 1]) == {"name": "/models/qwen3", "path": "/tmp/start"}
    assert serve_env(config)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in serve_env(vllm_config())
    named = vllm_config(engine={"lora": {"enabled": True}}, server={"base_model_name": "start"})
    assert serve_argv(named, "/tmp/start")[serve_argv(named, "/tmp/start").index("--served-model-name") + 1] == "start"
    with pytest.raises(ValueError, match=r"`engine.lora.rank` = 600: vLLM 0.26 serves adapters of rank at most 512"):
        mapped_flags(vllm_config(engine={"lora": {"enabled": True, "rank": 600}}), "/tmp/start")
    with pytest.raises(ValueError, match="needs the folder of the adapters it starts with"):
        mapped_flags(config)
    with pytest.raises(ValidationError, match="`server.base_model_name` with `run.exact`"):
        InferenceConfig.model_validate({"engine": {"lora": {"enabled": True}}, "server": {"base_model_name": "b"},
                                        "run": {"exact": True}})
    with pytest.raises(ValidationError, match="`server.base_model_name` is set but `engine.lora.enabled` is false"):
        vllm_config(server={"base_model_name": "b"})
    request = VllmDialect("/models/qwen3").to_request({"prompt_token_ids": [1], "max_tokens": 2})
    assert request["model"] == "/models/qwen3"  # the policy's name: in a LoRA run, its adapter's


def test_pass_through_errors_name_the_key():
    with pytest.raises(ValidationError, match="extra_args.max_model_len.*engine|extra_args.max_model_len"):
        vllm_config(vllm={"extra_args": {"max_model_len": 10}})
    config = vllm_config(vllm={"extra_args": {"enforce_eager": True, "speculative_wish": 3}})
    with pytest.raises(ValueError, match="extra_args.speculative_wish.*--speculative-wish"):
        check_extra_args(config, flags_in_help("  --enforce-eager  help\n  --no-enforce-eager\n  --port PORT"))
    assert flags_in_help("  --no-enable-prefix-caching, --enable-prefix-caching\n --max-num-seqs N") == {
        "enable_prefix_caching", "max_num_seqs"}


def test_what_vllm_cannot_serve_as_tandem_does_is_refused():
    with pytest.raises(ValidationError, match="`model.load_format` = 'dummy' with `backend` = 'vllm'"):
        vllm_config(model={"name": "/models/qwen3", "load_format": "dummy"})
    with pytest.raises(ValueError, match="router replay"):
        VllmDialect().to_request({"prompt_token_ids": [1], "max_tokens": 2, "return_routed_experts": True})
    request = VllmDialect().to_request({"prompt_token_ids": [1, 2], "max_tokens": 2, "temperature": 1.0})
    assert request == {"token_ids": [1, 2], "sampling_params": {"max_tokens": 2, "temperature": 1.0, "logprobs": 0}}


def fake_env(tmp_path: Path, path_dirs: tuple[Path, ...] = (FAKE,), **env: str) -> dict[str, str]:
    """The environment of `tandem inference` with only `path_dirs` and the system's folders on PATH."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "FAKE_VLLM"))}
    environ["PATH"] = os.pathsep.join([*map(str, path_dirs), *SYSTEM_PATH])
    environ["PYTHONPATH"] = str(REPO)  # a vLLM on the caller's PYTHONPATH must not answer either
    return environ | {"FAKE_VLLM_RECORD": str(tmp_path / "record.json"), **env}


def inference(tmp_path: Path, path_dirs: list[Path], *args: str, **env: str) -> subprocess.Popen:
    environ = fake_env(tmp_path, tuple(path_dirs), **env)
    return subprocess.Popen([sys.executable, "-m", "tandem.cli", "inference", "--backend", "vllm", "--model.name",
                             "/models/qwen3", *args], cwd=REPO, env=environ, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_missing_wrong_or_failing_vllm_is_an_error_with_its_last_lines(tmp_path):
    if shutil.which("vllm", path=os.pathsep.join(SYSTEM_PATH)):
        pytest.skip("a system-wide vllm would answer instead of the stand-in")
    missing = inference(tmp_path, [])
    _, err = missing.communicate(timeout=60)
    assert missing.returncode == 2 and "no `vllm` executable is on PATH and this Python cannot import it" in err
    assert "tandem-rl[vllm]" in err

    old = inference(tmp_path, [FAKE], FAKE_VLLM_VERSION="0.25.2")
    _, err = old.communicate(timeout=60)
    assert old.returncode == 2 and "is vLLM 0.25.2, tandem speaks vLLM 0.26" in err

    failing = inference(tmp_path, [FAKE], FAKE_VLLM_FAIL="1")
    _, err = failing.communicate(timeout=60)
    assert failing.returncode == 1 and "vLLM exited with code 3" in err and "| CUDA out of memory" in err

    # Importable but not on PATH (`pip install --target DIR`, DIR on PYTHONPATH): run as `python -m`.
    cli = tmp_path / "site" / "vllm" / "entrypoints" / "cli"
    cli.mkdir(parents=True)
    for folder in (cli, cli.parent, cli.parent.parent):
        (folder / "__init__.py").write_text("")
    (cli / "main.py").write_text(f"import runpy\nrunpy.run_path({str(FAKE / 'vllm')!r}, run_name='__main__')\n")
    module = inference(tmp_path, [], FAKE_VLLM_FAIL="1", PYTHONPATH=os.pathsep.join([str(REPO), str(tmp_path / "site")]))
    _, err = module.communicate(timeout=60)
    assert module.returncode == 1 and "vLLM exited with code 3" in err

    (tmp_path / "extra.toml").write_text("[vllm.extra_args]\nspeculative_wish = 3\n")
    unknown = inference(tmp_path, [FAKE], "@", str(tmp_path / "extra.toml"))
    _, err = unknown.communicate(timeout=60)
    assert unknown.returncode == 2 and "extra_args.speculative_wish" in err


def test_the_vllm_wrapper_loads_none_of_tandems_engine(tmp_path):
    """`tandem inference --backend vllm` imports only vLLM's wrapper: no torch (seconds of start-up and
    memory that vLLM's own process holds anyway)."""
    probe = ("import sys\nfrom tandem.cli import main\ncode = main(['inference', '--backend', 'vllm', '--model.name', "
             "'/models/qwen3'])\nprint(code, 'torch' in sys.modules)")
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "FAKE_VLLM"))}
    environ |= {"PATH": os.pathsep.join([str(FAKE), *SYSTEM_PATH]), "PYTHONPATH": str(REPO), "FAKE_VLLM_FAIL": "1",
                "FAKE_VLLM_RECORD": str(tmp_path / "record.json")}
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=environ, capture_output=True, text=True, timeout=60)
    assert "vLLM exited with code 3" in done.stderr, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1] == "1 False", done.stdout  # (vLLM's output comes first)


def is_healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def wait_healthy(proc: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + 60
    while not is_healthy(url):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1]
        time.sleep(0.1)


def test_serves_through_vllm_in_its_own_group_and_stops_with_it(tmp_path):
    port = free_port()
    proc = inference(tmp_path, [FAKE], "--server.port", str(port))
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url)
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["dev_mode"] == "1" and record["pgid"] == record["pid"] != os.getpgid(proc.pid)
    assert record["argv"][:2] == ["serve", "/models/qwen3"]

    folder = tmp_path / "step_1"
    folder.mkdir()
    save_file({"lm_head.weight": torch.zeros(2, 2)}, folder / "model.safetensors")
    info = update_info_of({"lm_head.weight": torch.zeros(2, 2, dtype=torch.bfloat16)}, bucket_bytes=2**20)

    async def drive():
        pool = InferencePool(ClientConfig(base_urls=[url], backend="vllm"))
        request = {"prompt_token_ids": [4, 9], "max_tokens": 3, "n": 1, "temperature": 1.0, "seed": 7}
        try:
            before = await pool.generate(request, 0)
            await pool.update_weights(str(folder), 1)
            after = await pool.generate(request, 0)
            await pool.init_weight_transfer([{"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1,
                                              "world_size": 2}])
            await pool.broadcast_update(msgspec.to_builtins(info), 2)
            return before, after, pool.versions
        finally:
            await pool.aclose()

    before, after, versions = asyncio.run(drive())
    choice = before["choices"][0]
    assert choice["token_ids"] == [10, 11, 12] and choice["logprobs"] == [-0.5, -1.0, -1.5]
    assert choice["weight_version"] == 0  # vLLM reports none: the version the server held when asked
    shift = after["choices"][0]["token_ids"][0] - 10  # the stand-in's answers depend on the weights it loaded
    assert shift > 0 and after["choices"][0]["token_ids"] == [10 + shift, 11 + shift, 12 + shift]
    assert after["choices"][0]["weight_version"] == 1
    assert versions == [2]
    calls = [json.loads(line) for line in (tmp_path / "record.json.calls").read_text().splitlines()]
    assert calls[:3] == [{"route": "/pause", "mode": "keep"},
                         {"route": "/collective_rpc", "method": "reload_weights", "kwargs": {"weights_path": str(folder)}},
                         {"route": "/resume"}]
    assert [c["route"] for c in calls[3:]] == ["/init_weight_transfer_engine", "/pause", "/start_weight_update",
                                                "/update_weights", "/finish_weight_update", "/resume"]
    assert calls[6]["update_info"]["dtype_names"] == ["bfloat16"] and calls[6]["update_info"]["packed"] is True

    # The orchestrator's preflight samples through the same dialect (vLLM's route, no echoed prompt).
    with httpx.Client(timeout=30) as client:
        turns, problems = sample_conversation(client, url, build_byte_tokenizer(), 0,
                                              OrchestratorConfig.model_validate({"client": {"backend": "vllm"},
                                                                                 "model": {"name": "/models/qwen3"}}))
    assert problems == [] and len(turns) == 2 and turns[1].logprobs[:2] == [-0.5, -1.0]

    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    with pytest.raises(ProcessLookupError):
        os.killpg(record["pgid"], 0)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_real_vllm_knows_every_flag_tandem_passes():
    from tandem.inference.vllm.server import find_vllm, known_flags

    assert TANDEM_SET_FLAGS <= known_flags(find_vllm())


def test_a_lora_run_loads_each_adapter_folder_in_place_and_keeps_the_base_by_name(tmp_path, tiny_dir):
    """vLLM starts with the policy's adapters at their start (B zero, a PEFT folder tandem writes from the model's
    config), requests name the policy, and each published adapter folder replaces it in place inside a pause."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", "inference", "--backend", "vllm", "--model.name",
                             str(tiny_dir), "--engine.lora.enabled", "true", "--engine.lora.rank", "4",
                             "--server.port", str(port)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=fake_env(tmp_path))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)
        argv = json.loads((tmp_path / "record.json").read_text())["argv"]
        assert argv[argv.index("--served-model-name") + 1] == f"{tiny_dir}-base"
        start = Path(json.loads(argv[argv.index("--lora-modules") + 1])["path"])
        spec, adapters = read_adapter_folder(start)
        assert spec == LoraSpec(4, 32.0, tuple(LoraConfig().target_modules))
        assert adapters and all(t.abs().sum() == 0 for n, t in adapters.items() if n.endswith(".lora_B.weight"))
        # The folders a LoRA trainer publishes: a new adapter each step.
        model = build_native(read_hf_config(tiny_dir))
        apply_lora(model, spec, "test")
        steps = []
        for step in (1, 2):
            state = {n: torch.full_like(t, 0.01 * step) for n, t in initial_adapters(model, step).items()}
            write_adapter_folder(tmp_path / f"step_{step}", state, spec, str(tiny_dir))
            steps.append(str(tmp_path / f"step_{step}"))

        async def drive():
            pool = InferencePool(ClientConfig(base_urls=[url], backend="vllm"), policy_name=str(tiny_dir))
            request = {"prompt_token_ids": [4, 9], "max_tokens": 2, "temperature": 1.0, "seed": 7}
            try:
                answers = [await pool.generate(request, 0)]
                for version, folder in enumerate(steps, 1):
                    await pool.update_weights(folder, version)
                    answers.append(await pool.generate(request, 0))
                return [a["choices"][0]["token_ids"][0] for a in answers], pool.versions
            finally:
                await pool.aclose()

        firsts, versions = asyncio.run(drive())
        assert len(set(firsts)) == 3 and versions == [2]  # each adapter answers otherwise (the stand-in's rule)
        calls = [json.loads(line) for line in (tmp_path / "record.json.calls").read_text().splitlines()]
        assert calls[:3] == [{"route": "/pause", "mode": "keep"},
                             {"route": "/v1/load_lora_adapter", "lora_name": str(tiny_dir), "lora_path": steps[0],
                              "load_inplace": True},
                             {"route": "/resume"}]
        base = httpx.post(f"{url}/inference/v1/generate", timeout=10,
                          json={"model": f"{tiny_dir}-base", "token_ids": [4, 9], "sampling_params": {"max_tokens": 2}})
        assert base.json()["choices"][0]["token_ids"] == [10, 11]  # the base, untouched by the adapters
        missing = httpx.post(f"{url}/inference/v1/generate", timeout=10,
                             json={"model": "nobody", "token_ids": [4, 9], "sampling_params": {"max_tokens": 2}})
        assert missing.status_code == 404
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    assert not start.exists()  # the start folder lives as long as the server


def test_a_decoder_model_with_a_draft_head_is_refused_before_vllm_starts(tmp_path, capsys):
    """vLLM's Qwen3 loader knows no layer after the last block: the head's weights could not load."""
    folder = tmp_path / "with-head"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_nextn_predict_layers": 1}))
    assert vllm_main(vllm_config(model={"name": str(folder)})) == 2
    assert (f"`backend` = 'vllm' cannot serve `model.name` = {str(folder)!r}: a 'qwen3' model with a draft head"
            in capsys.readouterr().err)


def test_fp8_rollouts_map_onto_vllms_block_fp8_and_a_released_fp8_checkpoint_is_read_as_it_is(tmp_path):
    fp8 = vllm_config(engine={"quantization": "fp8"})
    argv = serve_argv(fp8)
    assert argv[argv.index("--quantization") + 1] == "fp8_per_block"  # quantized on load, in tandem's blocks
    assert "--quantization" not in serve_argv(vllm_config())
    assert "--quantization" not in serve_argv(fp8, checkpoint_fp8=True)  # vLLM reads its `quantization_config`
    with pytest.raises(ValueError, match=r"`engine.quantization` = 'none' but /models/qwen3 is an FP8 checkpoint"):
        serve_argv(vllm_config(), checkpoint_fp8=True)
    folder = tmp_path / "released"
    folder.mkdir()
    scheme = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3", "quantization_config": scheme}))
    assert serves_fp8_checkpoint(vllm_config(model={"name": str(folder)}))
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    assert not serves_fp8_checkpoint(vllm_config(model={"name": str(folder)}))
    (folder / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(ValueError, match=r"released/config.json: `quantization_config.quant_method` = 'awq'"):
        serves_fp8_checkpoint(vllm_config(model={"name": str(folder)}))
