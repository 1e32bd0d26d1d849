"""Qwen3 (dense) in plain PyTorch, with Hugging Face state-dict names.

Shared by the trainer and the inference engine so both compute the same function; the block is
`tandem.models.decoder`'s, with per-head q/k norms and a dense SwiGLU feed-forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from tandem.models.decoder import Attention, DecoderLayer, DecoderLM
from tandem.models.hf_config import check_dense_attention, expect, rope_parameters, transformers_config
from tandem.models.layers import MLP


@dataclass
class Qwen3Args:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 40960

    @property
    def rotary_dim(self) -> int:
        """Features of each head that RoPE rotates: all of them."""
        return self.head_dim

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "Qwen3Args":
        """Read a Qwen3 `config.json`; unsupported values raise `UnsupportedConfig`."""
        return cls(**qwen3_fields(transformers_config(config)))


def qwen3_fields(config: Any) -> dict[str, Any]:
    """The `Qwen3Args` fields of a Qwen3 or Qwen3-MoE transformers config object."""
    check_dense_attention(config)
    rope = rope_parameters(config)
    expect(rope, "partial_rotary_factor", (1, 1.0), 1.0)
    heads = config.num_attention_heads
    return dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=heads,
        num_key_value_heads=config.num_key_value_heads or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=float(rope["rope_theta"]),
        tie_word_embeddings=config.tie_word_embeddings,
        attention_bias=config.attention_bias,
        max_position_embeddings=config.max_position_embeddings,
    )


def qwen3_layer(args: Qwen3Args, layer_idx: int, mlp: nn.Module) -> DecoderLayer:
    """A Qwen3 block around `mlp`: q/k norms per head, biases on all four projections or none."""
    attention = Attention(args.hidden_size, args.num_attention_heads, args.num_key_value_heads, args.head_dim,
                          args.rms_norm_eps, qkv_bias=args.attention_bias, o_bias=args.attention_bias, qk_norm="head")
    return DecoderLayer(layer_idx, attention, mlp, args.hidden_size, args.rms_norm_eps)


class Qwen3ForCausalLM(DecoderLM):
    """Dense Qwen3: every block's feed-forward is a SwiGLU `MLP`."""

    def __init__(self, args: Qwen3Args):
        super().__init__(args, [qwen3_layer(args, i, MLP(args.hidden_size, args.intermediate_size))
                                for i in range(args.num_hidden_layers)])
