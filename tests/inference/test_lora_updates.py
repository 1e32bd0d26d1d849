"""A LoRA policy on a live server: adapter folders merged into the kept base, and what a wrong update gets."""

from __future__ import annotations

import httpx
import pytest
import torch
from inference_helpers import LORA, adapter_folder, make_config, teacher_forced_logprobs

from tandem.config.inference import InferenceConfig
from tandem.inference.server import BackgroundServer
from tandem.models.loading import load_causal_lm
from tandem.models.lora import export_merged

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
    ({"engine": {"lora": {**LORA, "target_modules": []}}}, "`lora.target_modules` is empty"),
])
def test_lora_settings_the_engine_cannot_serve_are_config_errors(tiny_dir, config, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("`", ".")):
        InferenceConfig.model_validate({"model": {"name": str(tiny_dir)}, **config})
