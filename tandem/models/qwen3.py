"""Qwen3 (dense) in plain PyTorch, with Hugging Face state-dict names.

Shared by the trainer and the inference engine so both compute the same function; the block is
`tandem.models.decoder`'s, with per-head q/k norms and a dense SwiGLU feed-forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from tandem.models.decoder import Attention, DecoderArgs, DecoderLayer, DecoderLM
from tandem.models.hf_config import decoder_fields, expect, transformers_config
from tandem.models.layers import MLP


@dataclass(kw_only=True)
class Qwen3Args(DecoderArgs):
    intermediate_size: int
    attention_bias: bool = False
    """Biases on the q, k, v and o projections."""

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "Qwen3Args":
        """Read a Qwen3 `config.json`; unsupported values raise `UnsupportedConfig`."""
        return cls(**qwen3_fields(transformers_config(config)))


def qwen3_fields(config: Any) -> dict[str, Any]:
    """The `Qwen3Args` fields of a Qwen3 or Qwen3-MoE transformers config object."""
    fields = decoder_fields(config)
    expect(fields, "partial_rotary_factor", (1.0,))
    return dict(fields, intermediate_size=config.intermediate_size, attention_bias=config.attention_bias)


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
