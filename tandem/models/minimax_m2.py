"""MiniMax-M2 (`minimax_m2`): every block sparse, q/k norms over all heads, partial rotary.

As transformers 5 implements it (`MiniMaxM2*`), which is what the released config.json describes:
- attention without biases; `q_norm` and `k_norm` are RMS norms over the whole q (all heads,
  `num_attention_heads * head_dim` features) and k projections, before they are split into heads
  (`qk_norm_type` "per_layer"); RoPE on the first `rotary_dim` features of each head;
- feed-forward: a `moe.MoE` of `num_local_experts` experts of `intermediate_size` features, sigmoid
  scores plus `e_score_correction_bias` (on the block: `mlp.e_score_correction_bias`) to choose the
  `num_experts_per_tok` experts, whose unbiased scores are renormalized to sum to 1.
On disk the block is `block_sparse_moe` and the experts' projections `w1` (gate), `w3` (up), `w2`
(down); `tandem.models.expert_layout` converts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.models.decoder import Attention, DecoderArgs, DecoderLayer, DecoderLM
from tandem.models.hf_config import UnsupportedConfig, decoder_fields, expect, transformers_config
from tandem.models.moe import MoE, MoEArgs


@dataclass(kw_only=True)
class MiniMaxM2Args(DecoderArgs):
    intermediate_size: int
    """Hidden features of each expert's SwiGLU."""
    num_local_experts: int
    """Experts per block (every block is sparse)."""
    num_experts_per_tok: int

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "MiniMaxM2Args":
        """Read a MiniMax-M2 `config.json`, including the released file's fields transformers' class
        does not declare; unsupported values raise `UnsupportedConfig`."""
        hf = transformers_config(config)
        expect(hf, "router_jitter_noise", (0, 0.0), 0.0)
        expect(hf, "scoring_func", ("sigmoid",), "sigmoid")
        expect(hf, "use_routing_bias", (True,), True)
        expect(hf, "use_qk_norm", (True,), True)
        expect(hf, "qk_norm_type", ("per_layer",), "per_layer")
        expect(hf, "shared_intermediate_size", (0, None), 0)
        attention_types = getattr(hf, "attn_type_list", None) or []
        if any(t != 1 for t in attention_types):
            raise UnsupportedConfig("attn_type_list", attention_types, "only 1 (full softmax attention) in every layer")
        return cls(**decoder_fields(hf), intermediate_size=hf.intermediate_size, num_local_experts=hf.num_local_experts,
                   num_experts_per_tok=hf.num_experts_per_tok)

    def moe_args(self) -> MoEArgs:
        return MoEArgs(num_experts=self.num_local_experts, top_k=self.num_experts_per_tok, hidden_size=self.hidden_size,
                       intermediate_size=self.intermediate_size, score_func="sigmoid", norm_topk_prob=True,
                       score_bias="block")


class MiniMaxM2ForCausalLM(DecoderLM):
    def __init__(self, args: MiniMaxM2Args):
        def layer(i: int) -> DecoderLayer:
            attention = Attention(args.hidden_size, args.num_attention_heads, args.num_key_value_heads, args.head_dim,
                                  args.rms_norm_eps, qkv_bias=False, o_bias=False, qk_norm="all_heads")
            return DecoderLayer(i, attention, MoE(args.moe_args()), args.hidden_size, args.rms_norm_eps)

        super().__init__(args, [layer(i) for i in range(args.num_hidden_layers)])
