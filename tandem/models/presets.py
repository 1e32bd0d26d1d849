"""Model presets for `tandem model init`: Qwen3 shapes built locally with random weights."""

from __future__ import annotations

from pathlib import Path

import torch

from tandem.models.byte_tokenizer import VOCAB_SIZE, save_byte_tokenizer

PRESETS: dict[str, dict] = {
    # ~0.43M parameters: learns character-level tasks on a laptop CPU in minutes.
    "tiny": dict(vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                 max_position_embeddings=4096, dtype="float32"),
    # ~3.2M parameters.
    "small": dict(vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True,
                  max_position_embeddings=8192, dtype="float32"),
    # The real Qwen3-0.6B shape and vocabulary size (the byte tokenizer uses the first 260 ids).
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                       max_position_embeddings=40960, dtype="bfloat16"),
}


def init_model(preset: str, out: Path, seed: int = 0) -> Path:
    """Write a Hugging Face folder (config, safetensors, tokenizer, generation config) for `preset`."""
    from transformers import GenerationConfig, Qwen3Config

    from tandem.models.loading import build_native
    from tandem.models.weights import save_state_dict

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    shape = dict(PRESETS[preset])
    dtype = shape.pop("dtype")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    eos, pad, bos = 258, 259, 256  # <|im_end|>, <pad>, <|endoftext|>
    hf_config = Qwen3Config(**shape, rms_norm_eps=1e-6, rope_theta=1_000_000.0, attention_bias=False,
                            bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, dtype=dtype,
                            architectures=["Qwen3ForCausalLM"])
    hf_config.save_pretrained(str(out))
    GenerationConfig(bos_token_id=bos, eos_token_id=[eos, bos], pad_token_id=pad).save_pretrained(str(out))
    config_dict = hf_config.to_dict()
    model = build_native(config_dict, device="cpu", dtype=torch.float32)
    model.init_weights(torch.Generator().manual_seed(seed))
    torch_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    state = {k: v.to(torch_dtype) for k, v in model.state_dict().items()}
    save_state_dict(state, out, tied_embeddings=shape["tie_word_embeddings"])
    save_byte_tokenizer(out)
    return out
