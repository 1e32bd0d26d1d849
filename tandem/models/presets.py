"""Model presets for `tandem model init`: shapes of the native families built locally with random weights.

The small presets use the byte tokenizer's vocabulary and learn on a CPU; the real shapes keep
their family's vocabulary size (the byte tokenizer uses its first 260 ids) so that speed and
memory are the real model's. Their weights need not be written: `init_model(..., weights=False)`
writes the config and tokenizer only, and `model.load_format = "dummy"` makes the weights on the
device (`tandem.models.random_init`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from tandem.models.byte_tokenizer import VOCAB_SIZE, save_byte_tokenizer

_TINY_ATTENTION = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                       max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1_000_000.0, dtype="float32")

PRESETS: dict[str, dict] = {
    # ~0.43M parameters: learns character-level tasks on a laptop CPU in minutes.
    "tiny": dict(model_type="qwen3", vocab_size=VOCAB_SIZE, intermediate_size=384, num_hidden_layers=2, **_TINY_ATTENTION),
    # ~3.2M parameters.
    "small": dict(model_type="qwen3", vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True,
                  max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=1_000_000.0, dtype="float32"),
    # The real Qwen3-0.6B shape and vocabulary size.
    "qwen3-0.6b": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                       max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1_000_000.0, dtype="bfloat16"),
    # The real Qwen3-4B and Qwen3-8B shapes: LoRA on one 24 GB GPU (`examples/reverse_text/rl_lora_gpu.toml`).
    "qwen3-4b": dict(model_type="qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                     max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1_000_000.0, dtype="bfloat16"),
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                     max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1_000_000.0, dtype="bfloat16"),
    # Qwen3-MoE, ~0.5M parameters (8 experts of 64 features, 2 per token): runs on a CPU in seconds.
    "tiny-moe": dict(model_type="qwen3_moe", vocab_size=VOCAB_SIZE, intermediate_size=384, num_hidden_layers=2,
                     num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
                     decoder_sparse_step=1, mlp_only_layers=[], **_TINY_ATTENTION),
    # GLM-4.5's routing at a CPU size: dense first block, 8 experts in 4 groups (2 chosen), 2 per token, 1 shared.
    "tiny-glm4-moe": dict(model_type="glm4_moe", vocab_size=VOCAB_SIZE, intermediate_size=192, num_hidden_layers=3,
                          moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                          n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
                          attention_bias=True, use_qk_norm=False, num_nextn_predict_layers=0,
                          rope_parameters=dict(partial_rotary_factor=0.5), **_TINY_ATTENTION),
    # MiniMax-M2's block at a CPU size: 8 experts, 2 per token, q/k norms over all heads, half the head rotary.
    "tiny-minimax-m2": dict(model_type="minimax_m2", vocab_size=VOCAB_SIZE, intermediate_size=32, num_hidden_layers=2,
                            num_local_experts=8, num_experts_per_tok=2, rope_parameters=dict(partial_rotary_factor=0.5),
                            **_TINY_ATTENTION),
    # GLM-5's block at a CPU size: MLA (query rank 64, key/value rank 32, heads of 32 + 16 RoPE features), a DSA
    # indexer of 8 heads in every other layer (the others share its choice) keeping 64 tokens per query, GLM-4.5's
    # routing after a dense first block, one multi-token prediction layer.
    "tiny-glm5": dict(model_type="glm_moe_dsa", vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=192,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=32,
                      qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, index_topk=64, index_n_heads=8,
                      index_head_dim=32, index_topk_freq=2, index_skip_topk_offset=1, moe_intermediate_size=32,
                      n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
                      routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1, num_nextn_predict_layers=1,
                      tie_word_embeddings=False, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=1_000_000.0,
                      dtype="float32"),
    # The real Qwen3-30B-A3B shape (48 layers, 128 experts, 8 per token).
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                          decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
                          max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1_000_000.0, dtype="bfloat16"),
    # The real GLM-4.5-Air shape (46 layers, the first dense; 128 routed experts, 8 per token, 1 shared).
    "glm-4.5-air": dict(model_type="glm4_moe", vocab_size=151552, hidden_size=4096, intermediate_size=10944,
                        num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
                        moe_intermediate_size=1408, n_routed_experts=128, n_shared_experts=1, num_experts_per_tok=8,
                        n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True, first_k_dense_replace=1,
                        attention_bias=True, use_qk_norm=False, num_nextn_predict_layers=0, tie_word_embeddings=False,
                        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=1_000_000.0,
                        rope_parameters=dict(partial_rotary_factor=0.5), dtype="bfloat16"),
    # The real GLM-5 shape (78 layers, the first 3 dense; MLA; a DSA indexer in every layer keeping 2,048 tokens per
    # query; 256 routed experts, 8 per token, 1 shared; one multi-token prediction layer).
    "glm-5": dict(model_type="glm_moe_dsa", vocab_size=154880, hidden_size=6144, intermediate_size=12288,
                  num_hidden_layers=78, num_attention_heads=64, num_key_value_heads=64, q_lora_rank=2048, kv_lora_rank=512,
                  qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, index_topk=2048, index_n_heads=32,
                  index_head_dim=128, moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1,
                  num_experts_per_tok=8, n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                  first_k_dense_replace=3, num_nextn_predict_layers=1, tie_word_embeddings=False,
                  max_position_embeddings=202752, rms_norm_eps=1e-5, rope_theta=1_000_000.0, dtype="bfloat16"),
    # The real MiniMax-M2 shape (62 layers, 256 experts, 8 per token, rotary on 64 of 128 features).
    "minimax-m2": dict(model_type="minimax_m2", vocab_size=200064, hidden_size=3072, intermediate_size=1536,
                       num_hidden_layers=62, num_attention_heads=48, num_key_value_heads=8, head_dim=128,
                       num_local_experts=256, num_experts_per_tok=8, tie_word_embeddings=False,
                       max_position_embeddings=196608, rms_norm_eps=1e-6, rope_theta=5_000_000.0,
                       rope_parameters=dict(partial_rotary_factor=0.5), dtype="bfloat16"),
}


PRESETS["tiny-deepseek-v3"] = dict({k: v for k, v in PRESETS["tiny-glm5"].items() if not k.startswith("index")},
                                   model_type="deepseek_v3", n_group=4, topk_group=2)
"""DeepSeek-V3's block at tiny-glm5's size: MLA without DSA, 8 experts in 4 groups (2 chosen)."""


def preset_config(preset: str, num_layers: int | None = None, max_position_embeddings: int | None = None) -> dict:
    """The complete config.json of `preset` (as transformers writes it), cut to `num_layers` blocks and,
    with `max_position_embeddings` past the preset's, extended to it by YaRN (see `with_context`)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    shape = dict(PRESETS[preset])
    if num_layers is not None:
        if not 1 <= num_layers <= shape["num_hidden_layers"]:
            raise ValueError(f"`--num-layers` = {num_layers}: preset {preset!r} has 1 to {shape['num_hidden_layers']} layers")
        shape["num_hidden_layers"] = num_layers
    if max_position_embeddings is not None:
        shape = with_context(shape, max_position_embeddings)
    return shape_config(shape)


def with_context(shape: dict, max_position_embeddings: int) -> dict:
    """`shape` with a context of `max_position_embeddings` tokens: past the shape's own, through YaRN with
    factor = new / old and the old length as `original_max_position_embeddings` (Qwen3's recipe for 128k)."""
    if max_position_embeddings < 2:
        raise ValueError(f"`--max-position-embeddings` = {max_position_embeddings}: at least 2")
    original = shape["max_position_embeddings"]
    shape = dict(shape, max_position_embeddings=max_position_embeddings)
    if max_position_embeddings > original:
        shape["rope_parameters"] = {**shape.get("rope_parameters", {}), "rope_type": "yarn",
                                    "factor": max_position_embeddings / original, "original_max_position_embeddings": original}
    return shape


def shape_config(shape: dict) -> dict:
    """A complete config.json from a shape (`model_type`, `rope_theta`, optional `rope_parameters`, fields
    of the family's transformers config), with the byte tokenizer's special token ids."""
    from transformers import AutoConfig

    shape = dict(shape)
    model_type = shape.pop("model_type")
    rope = {"rope_type": "default", "rope_theta": shape.pop("rope_theta"), **shape.pop("rope_parameters", {})}
    eos, pad, bos = 258, 259, 256  # <|im_end|>, <pad>, <|endoftext|>
    config = AutoConfig.for_model(model_type, **shape, rope_parameters=rope, bos_token_id=bos, eos_token_id=eos,
                                  pad_token_id=pad, architectures=[ARCHITECTURES[model_type]])
    return config.to_dict()


ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
                 "minimax_m2": "MiniMaxM2ForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM",
                 "deepseek_v3": "DeepseekV3ForCausalLM"}
"""model_type -> the transformers class named in config.json's `architectures`."""


def init_model(preset: str, out: Path, seed: int = 0, num_layers: int | None = None, weights: bool = True,
               max_position_embeddings: int | None = None, draft_head: bool = False) -> Path:
    """Write a Hugging Face folder (config, safetensors, tokenizer, generation config) for `preset`;
    `weights=False` leaves the safetensors out (load it with `model.load_format = "dummy"`); `draft_head`: with a
    draft head (`tandem.models.draft_head`), random as the rest."""
    from tandem.models.draft_head import with_draft_head

    config = preset_config(preset, num_layers, max_position_embeddings)
    if draft_head:
        config = with_draft_head(config, f"preset {preset!r}")
    return write_model(config, out, seed, weights)


def write_model(hf_config: dict, out: Path, seed: int = 0, weights: bool = True) -> Path:
    """Write a model folder of `hf_config` with random weights (see `init_model`)."""
    from transformers import GenerationConfig

    from tandem.models.hf_config import transformers_config
    from tandem.models.loading import empty_native
    from tandem.models.weights import save_state_dict

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    GenerationConfig(bos_token_id=hf_config["bos_token_id"], eos_token_id=[hf_config["eos_token_id"], hf_config["bos_token_id"]],
                     pad_token_id=hf_config["pad_token_id"]).save_pretrained(str(out))
    save_byte_tokenizer(out)
    if weights:
        model = empty_native(hf_config, "cpu", torch.float32)
        model.init_weights(seed)
        torch_dtype = getattr(torch, hf_config["dtype"])
        save_state_dict({k: v.to(torch_dtype) for k, v in model.state_dict().items()}, out, hf_config)
    transformers_config(hf_config).save_pretrained(str(out))
    return out
