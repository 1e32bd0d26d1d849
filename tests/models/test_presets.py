"""`tandem model init`: deterministic folders that transformers loads and tandem's model matches."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.models.byte_tokenizer import SPECIAL_TOKENS
from tandem.models.loading import load_causal_lm
from tandem.models.presets import init_model


def digest(folder) -> str:
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()


def test_init_is_deterministic_given_seed(tmp_path):
    a = init_model("tiny", tmp_path / "a", seed=1)
    b = init_model("tiny", tmp_path / "b", seed=1)
    c = init_model("tiny", tmp_path / "c", seed=2)
    assert digest(a) == digest(b) != digest(c)


def test_tiny_round_trips_through_transformers(tmp_path):
    folder = init_model("tiny", tmp_path / "m", seed=0)
    hf = AutoModelForCausalLM.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    n_params = sum(p.numel() for p in hf.parameters())
    assert 350_000 < n_params < 500_000
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [256, 257, 258, 259]
    text = "héllo, wörld"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(prompt, return_tensors="pt").input_ids
    out = hf.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 4 or out[0, -1].item() in (256, 258)

    ours = load_causal_lm(str(folder))
    positions = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        logits = ours.lm_head(ours(ids, positions))
        torch.testing.assert_close(logits, hf(ids).logits, atol=1e-5, rtol=1e-5)


def test_packed_rows_equal_separate_sequences(tmp_path):
    model = load_causal_lm(str(init_model("tiny", tmp_path / "m", seed=0)))
    a, b = torch.randint(0, 256, (1, 9)), torch.randint(0, 256, (1, 5))
    with torch.no_grad():
        ha = model(a, torch.arange(9)[None])
        hb = model(b, torch.arange(5)[None])
        packed = model(torch.cat([a, b], 1), torch.cat([torch.arange(9), torch.arange(5)])[None])
    torch.testing.assert_close(packed[:, :9], ha, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed[:, 9:], hb, atol=1e-5, rtol=1e-5)


def test_small_preset_shape(tmp_path):
    folder = init_model("small", tmp_path / "s", seed=0)
    config = json.loads((folder / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["model_type"]) == (256, 4, "qwen3")
    model = load_causal_lm(str(folder))
    assert 2.5e6 < sum(p.numel() for p in model.parameters()) < 4e6


def test_unknown_preset_and_missing_folder(tmp_path):
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        init_model("huge", tmp_path / "x")
    with pytest.raises(FileNotFoundError, match="neither a model folder nor a hub name"):
        load_causal_lm(str(tmp_path / "nope"))


def test_real_shape_config_only_cut_to_k_layers(tmp_path):
    """`--config-only` writes no weights; the full Qwen3-30B-A3B shape has its 30.5B parameters."""
    from tandem.models.cli import main
    from tandem.models.loading import build_native, read_hf_config
    from tandem.models.presets import preset_config

    assert main(["init", "--preset", "qwen3-30b-a3b", "--num-layers", "2", "--config-only", "--out", str(tmp_path / "m")]) == 0
    config = read_hf_config(tmp_path / "m")
    assert (config["num_hidden_layers"], config["model_type"]) == (2, "qwen3_moe")
    assert not list((tmp_path / "m").glob("*.safetensors"))
    assert AutoTokenizer.from_pretrained(tmp_path / "m").convert_tokens_to_ids("<|im_end|>") == 258
    full = build_native(preset_config("qwen3-30b-a3b"), "meta")
    assert 30.4e9 < sum(p.numel() for p in full.parameters()) < 30.6e9
    with pytest.raises(ValueError, match="`--num-layers` = 49"):
        preset_config("qwen3-30b-a3b", num_layers=49)


def test_dummy_weights_are_the_weights_init_writes(tmp_path):
    """`load_format = "dummy"` on a config-only folder makes, without reading or writing weights, the
    model `tandem model init` writes for the same preset."""
    written = load_causal_lm(str(init_model("tiny-glm4-moe", tmp_path / "w", seed=0)))
    dummy = load_causal_lm(str(init_model("tiny-glm4-moe", tmp_path / "d", weights=False)), load_format="dummy")
    assert not list((tmp_path / "d").glob("*.safetensors"))
    expected = written.state_dict()
    for name, tensor in dummy.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    assert dummy.state_dict()["model.layers.1.mlp.experts.gate_up_proj"].std() > 0.01


def test_dummy_weights_need_a_native_model(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                 num_key_value_heads=2)).save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match="`model.load_format` = 'dummy' needs a native model; 'llama'"):
        load_causal_lm(str(tmp_path / "llama"), load_format="dummy")
