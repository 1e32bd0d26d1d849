"""A LoRA policy on a live server: adapter folders merged into the kept base, and what a wrong update gets."""

from __future__ import annotations

import httpx
import pytest
import torch
from inference_helpers import LORA, adapter_folder, make_config, teacher_forced_logprobs

from tandem.config.inference import InferenceConfig
from tandem.inference.server import BackgroundServer
from tandem.models.loading import load_causal_lm
from tandem.models.lora import LoraSpec, apply_lora, export_merged, lora_experts, write_adapter_folder


@pytest.fixture(scope="module")
def lora_server(tiny_dir):
    running = BackgroundServer(make_config(tiny_dir, lora=LORA))
    yield running
    running.stop()


def generate(server, prompt: list[int]) -> dict:
    body = {"prompt_token_ids": prompt, "max_tokens": 12, "seed": 3, "ignore_eos": True}
    response = httpx.post(f"{server.url}/v1/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_adapter_updates_serve_the_merged_policy_and_bad_ones_change_nothing(lora_server, tiny_dir, tmp_path):
    prompt = [5, 17, 99, 3, 42]
    base = load_causal_lm(str(tiny_dir), "cpu", "float32")
    choice = generate(lora_server, prompt)
    torch.testing.assert_close(torch.tensor(choice["logprobs"]), teacher_forced_logprobs(base, prompt, choice["token_ids"], 1.0),
                               atol=1e-5, rtol=0)
    for seed in (1, 2):
        adapter_folder(tiny_dir, tmp_path / f"a{seed}", seed)
        response = httpx.post(f"{lora_server.url}/update_weights", json={"path": str(tmp_path / f"a{seed}")}, timeout=60)
        assert response.status_code == 200, response.text
    merged = load_causal_lm(str(export_merged(tmp_path / "a2", tmp_path / "merged2")), "cpu", "float32")
    choice = generate(lora_server, prompt)
    served = torch.tensor(choice["logprobs"])
    torch.testing.assert_close(served, teacher_forced_logprobs(merged, prompt, choice["token_ids"], 1.0), atol=1e-5, rtol=0)
    assert not torch.allclose(served, teacher_forced_logprobs(base, prompt, choice["token_ids"], 1.0), atol=1e-2)

    adapter_folder(tiny_dir, tmp_path / "rank8", 3, rank=8)
    for path, message in ((tmp_path / "rank8", "adapters of rank 8 and alpha 8.0; this server merges rank 4 and alpha 8.0"),
                          (tiny_dir, "holds adapters only, not full weights")):
        response = httpx.post(f"{lora_server.url}/update_weights", json={"path": str(path)}, timeout=60)
        assert response.status_code == 400 and message in response.json()["error"]["message"], response.text
    assert generate(lora_server, prompt) == choice  # the refused updates changed nothing


def test_adapters_sent_to_a_server_of_full_weights_are_refused(server, tiny_dir, tmp_path):
    adapter_folder(tiny_dir, tmp_path / "a", 1)
    response = httpx.post(f"{server.url}/update_weights", json={"path": str(tmp_path / "a")}, timeout=60)
    assert response.status_code == 400
    assert "LoRA adapters sent to a server of full weights: set `engine.lora.enabled`" in response.json()["error"]["message"]


@pytest.mark.parametrize("engine, message", [
    ({"lora": {**LORA, "target_modules": ["q_proj", "qkv"]}}, "`engine.lora.target_modules` names ['qkv'], which match no"),
    ({"lora": {**LORA, "target_experts": ["down_proj"]}}, "`engine.lora.target_experts` names ['down_proj'], but the model "
                                                          "has no routed experts"),
])
def test_targets_that_name_nothing_are_refused_at_start(tiny_dir, engine, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        BackgroundServer(make_config(tiny_dir, **engine))


@pytest.mark.parametrize("config, message", [
    ({"engine": {"lora": LORA}, "server": {"base_model_name": "b"}, "run": {"exact": True}},
     "`server.base_model_name` with `run.exact`: tandem's engine serves the base model"),
    ({"engine": {"lora": LORA, "speculative": {"method": "ngram"}}, "server": {"base_model_name": "b"}},
     "`server.base_model_name` with `engine.speculative`"),
    ({"engine": {"lora": LORA}, "server": {"base_model_name": "b"}, "disaggregation": {"role": "prefill"}},
     "`server.base_model_name` with `disaggregation.role` = 'prefill'"),
    ({"server": {"base_model_name": "b"}}, "`server.base_model_name` is set but `engine.lora.enabled` is false"),
    ({"engine": {"lora": LORA, "quantization": "fp8"}}, "merged into the base's weights in `model.dtype`"),
    ({"engine": {"lora": {**LORA, "target_modules": []}}}, "`lora.target_modules` and `lora.target_experts` are empty"),
    ({"engine": {"lora": {**LORA, "target_experts": ["gate_proj"]}}}, "Input should be 'gate_up_proj' or 'down_proj'"),
    ({"backend": "vllm", "engine": {"lora": {**LORA, "target_experts": ["down_proj"]}}},
     "with `backend` = 'vllm': vLLM 0.26 reads PEFT's adapters of stacked experts correctly only"),
])
def test_lora_settings_the_engine_cannot_serve_are_config_errors(tiny_dir, config, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("`", ".")):
        InferenceConfig.model_validate({"model": {"name": str(tiny_dir)}, **config})


def test_expert_adapter_updates_serve_the_trainer_s_policy(tiny_moe_dir, tmp_path):
    """A mixture of experts with an adapter on every expert: the server's logprobs after an update are the trainer's
    forward (the model with `LoraExperts`) at the mismatch of the dense adapters, and the base's before it."""
    spec = LoraSpec(4, 8.0, ("q_proj", "o_proj"), ("gate_up_proj", "down_proj"))
    lora = {"enabled": True, "rank": 4, "alpha": 8.0, "target_modules": list(spec.target_modules),
            "target_experts": list(spec.target_experts)}
    trainer = load_causal_lm(str(tiny_moe_dir), "cpu", "float32")
    apply_lora(trainer, spec, source="test")
    gen = torch.Generator().manual_seed(5)
    adapters = {n: torch.randn(p.shape, generator=gen) * 0.2 for n, p in trainer.named_parameters() if "lora_" in n}
    trainer.load_state_dict(adapters, strict=False)
    assert len(lora_experts(trainer)) == 2 and any("experts.down_proj_lora_B" in n for n in adapters)
    write_adapter_folder(tmp_path / "a", adapters, spec, str(tiny_moe_dir))
    base = load_causal_lm(str(tiny_moe_dir), "cpu", "float32")
    prompt = [5, 17, 99, 3, 42]
    running = BackgroundServer(make_config(tiny_moe_dir, lora=lora))
    try:
        choice = generate(running, prompt)
        torch.testing.assert_close(torch.tensor(choice["logprobs"]),
                                   teacher_forced_logprobs(base, prompt, choice["token_ids"], 1.0), atol=1e-5, rtol=0)
        response = httpx.post(f"{running.url}/update_weights", json={"path": str(tmp_path / "a")}, timeout=60)
        assert response.status_code == 200, response.text
        choice = generate(running, prompt)
    finally:
        running.stop()
    served = torch.tensor(choice["logprobs"])
    torch.testing.assert_close(served, teacher_forced_logprobs(trainer, prompt, choice["token_ids"], 1.0), atol=1e-5, rtol=0)
    assert not torch.allclose(served, teacher_forced_logprobs(base, prompt, choice["token_ids"], 1.0), atol=1e-2)
