"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention and norms, a sparse feed-forward.

Block i is sparse (`moe.MoE`, softmax top-k router) unless i is in `mlp_only_layers` or
(i + 1) is not a multiple of `decoder_sparse_step`; dense blocks keep Qwen3's SwiGLU `MLP`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from tandem.models.decoder import DecoderLM
from tandem.models.hf_config import transformers_config
from tandem.models.layers import MLP
from tandem.models.moe import MoE, MoEArgs
from tandem.models.qwen3 import Qwen3Args, qwen3_fields, qwen3_layer


@dataclass(kw_only=True)
class Qwen3MoeArgs(Qwen3Args):
    num_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    """Hidden features of each expert's SwiGLU (`intermediate_size` is the dense blocks')."""
    norm_topk_prob: bool = False
    """Renormalize the chosen experts' softmax probabilities to sum to 1."""
    decoder_sparse_step: int = 1
    """Every this many blocks is sparse (block i when (i + 1) is a multiple)."""
    mlp_only_layers: list[int] = field(default_factory=list)
    """Blocks kept dense whatever `decoder_sparse_step` says."""

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "Qwen3MoeArgs":
        """Read a Qwen3-MoE `config.json`; unsupported values raise `UnsupportedConfig`."""
        hf = transformers_config(config)
        return cls(**qwen3_fields(hf), num_experts=hf.num_experts, num_experts_per_tok=hf.num_experts_per_tok,
                   moe_intermediate_size=hf.moe_intermediate_size, norm_topk_prob=hf.norm_topk_prob,
                   decoder_sparse_step=hf.decoder_sparse_step, mlp_only_layers=list(hf.mlp_only_layers or []))

    def is_sparse(self, layer_idx: int) -> bool:
        """transformers' rule for which blocks hold experts."""
        return (layer_idx not in self.mlp_only_layers and self.num_experts > 0
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    def moe_args(self) -> MoEArgs:
        return MoEArgs(num_experts=self.num_experts, top_k=self.num_experts_per_tok, hidden_size=self.hidden_size,
                       intermediate_size=self.moe_intermediate_size, score_func="softmax", norm_topk_prob=self.norm_topk_prob)


class Qwen3MoeForCausalLM(DecoderLM):
    def __init__(self, args: Qwen3MoeArgs):
        def feed_forward(i: int) -> nn.Module:
            return MoE(args.moe_args()) if args.is_sparse(i) else MLP(args.hidden_size, args.intermediate_size)

        super().__init__(args, [qwen3_layer(args, i, feed_forward(i)) for i in range(args.num_hidden_layers)])
