"""Fixtures of the trainer tests: tiny model folders made once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.models.presets import init_model, preset_config, write_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return init_model("tiny", tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_moe_model(tmp_path_factory) -> Path:
    """Qwen3-MoE with 8 experts, 2 per token."""
    return init_model("tiny-moe", tmp_path_factory.mktemp("models") / "tiny-moe", seed=0)


@pytest.fixture(scope="session")
def tiny_glm_model(tmp_path_factory) -> Path:
    """GLM-4.5's routing: a dense first block, grouped sigmoid top-k with a score correction bias, a shared expert."""
    return init_model("tiny-glm4-moe", tmp_path_factory.mktemp("models") / "tiny-glm4-moe", seed=0)


@pytest.fixture(scope="session")
def tiny_minimax_model(tmp_path_factory) -> Path:
    """MiniMax-M2's block: q/k norms over all heads, partial rotary, a score correction bias."""
    return init_model("tiny-minimax-m2", tmp_path_factory.mktemp("models") / "tiny-minimax-m2", seed=0)


@pytest.fixture(scope="session")
def tiny_glm5_model(tmp_path_factory) -> Path:
    """GLM-5's blocks (MLA, DSA indexers, GLM-4.5's routing) keeping 8 tokens a query, so that rows of documents of
    a dozen tokens or more take the sparse path."""
    return write_model(dict(preset_config("tiny-glm5"), index_topk=8), tmp_path_factory.mktemp("models") / "tiny-glm5")


@pytest.fixture(scope="session")
def tiny_deepseek_model(tmp_path_factory) -> Path:
    """DeepSeek-V3's blocks: MLA without DSA, grouped routing."""
    return init_model("tiny-deepseek-v3", tmp_path_factory.mktemp("models") / "tiny-deepseek-v3", seed=0)


@pytest.fixture(scope="session")
def llama_model(tmp_path_factory) -> Path:
    """A transformers-only architecture (Llama), to exercise the fallback path."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=128)
    folder = tmp_path_factory.mktemp("models") / "llama"
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder
