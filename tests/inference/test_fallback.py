"""Architectures tandem does not implement run through transformers, recomputed every step."""

import random

import httpx
import pytest
import torch
from inference_helpers import make_config, teacher_forced_logprobs

from tandem.inference.engine.model_runner import RecomputeModelRunner
from tandem.inference.server import BackgroundServer
from tandem.models.byte_tokenizer import VOCAB_SIZE, save_byte_tokenizer
from tandem.models.loading import load_causal_lm


def tiny_llama(folder, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, eos_token_id=258, pad_token_id=259, bos_token_id=256)
    LlamaForCausalLM(config).save_pretrained(str(folder))
    save_byte_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory):
    folder = tiny_llama(tmp_path_factory.mktemp("llama"), seed=0)
    running = BackgroundServer(make_config(folder, num_blocks=None, max_model_len=512))
    yield folder, running
    running.stop()


def test_transformers_model_serves_with_teacher_forced_logprobs(llama_server):
    folder, running = llama_server
    assert isinstance(running.served.engine.engine.runner, RecomputeModelRunner)
    model = load_causal_lm(str(folder))
    rng = random.Random(5)
    for i in range(3):
        prompt = [rng.randrange(256) for _ in range(rng.randint(1, 30))]
        body = httpx.post(f"{running.url}/v1/generate", timeout=60, json={
            "prompt_token_ids": prompt, "n": 2, "max_tokens": 12, "temperature": 0.8, "seed": i, "ignore_eos": True}).json()
        for choice in body["choices"]:
            expected = teacher_forced_logprobs(model, prompt, choice["token_ids"], 0.8)
            assert torch.allclose(torch.tensor(choice["logprobs"]), expected, atol=1e-5, rtol=0)


def test_transformers_model_takes_weight_updates(llama_server, tmp_path):
    folder, running = llama_server
    other = tiny_llama(tmp_path / "other", seed=1)  # save_pretrained leaves out the tied lm_head
    response = httpx.post(f"{running.url}/update_weights", json={"path": str(other)}, timeout=60)
    assert response.json() == {"weight_version": 1}
    body = httpx.post(f"{running.url}/v1/generate", timeout=60,
                      json={"prompt_token_ids": [1, 2], "max_tokens": 8, "seed": 0, "ignore_eos": True}).json()
    expected = teacher_forced_logprobs(load_causal_lm(str(other)), [1, 2], body["choices"][0]["token_ids"], 1.0)
    assert torch.allclose(torch.tensor(body["choices"][0]["logprobs"]), expected, atol=1e-5, rtol=0)
