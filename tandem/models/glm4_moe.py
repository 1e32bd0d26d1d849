"""GLM-4.5 / GLM-4.5-Air / GLM-4.6 (`glm4_moe`): DeepSeek-V3-style routing on a grouped-query block.

- attention: biases on q, k, v (not o) when `attention_bias`; per-head q/k norms only with
  `use_qk_norm`; RoPE on the first `partial_rotary_factor` of each head (half by default);
- feed-forward: the first `first_k_dense_replace` blocks are dense SwiGLU, the others a `moe.MoE`
  with sigmoid scores, `e_score_correction_bias` on the router (choice only), group-limited top-k
  (`n_group`, `topk_group`), renormalized (`norm_topk_prob`), scaled by `routed_scaling_factor`,
  plus `n_shared_experts` shared experts.
The multi-token-prediction layers of the checkpoints (`num_nextn_predict_layers`, after the last block) are kept
as `model.mtp_layers` (`decoder.DraftHead` around the family's routed block, as the checkpoints hold it): not part of
the causal LM's forward, frozen unless the trainer trains them, drafted with by `engine.speculative.method = "mtp"`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from tandem.models.decoder import Attention, DecoderArgs, DecoderLayer, DecoderLM, DraftHead
from tandem.models.hf_config import UnsupportedConfig, decoder_fields, transformers_config
from tandem.models.layers import MLP
from tandem.models.moe import MoE, MoEArgs


@dataclass(kw_only=True)
class Glm4MoeArgs(DecoderArgs):
    intermediate_size: int
    """Hidden features of the dense blocks' SwiGLU."""
    moe_intermediate_size: int
    """Hidden features of each routed expert's SwiGLU (and of each shared expert)."""
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int = 1
    """Groups the routed experts are split into; a token chooses among its `topk_group` best groups."""
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    """Multiplies the routing weights."""
    norm_topk_prob: bool = True
    """Renormalize the chosen experts' sigmoid scores to sum to 1."""
    first_k_dense_replace: int = 1
    """The first this many blocks are dense."""
    attention_bias: bool = False
    """Biases on the q, k and v projections (o has none)."""
    use_qk_norm: bool = False
    """RMS norms on each head of q and k."""

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "Glm4MoeArgs":
        """Read a GLM-4.5 `config.json`; unsupported values raise `UnsupportedConfig`."""
        hf = transformers_config(config)
        return cls(**decoder_fields(hf), **routing_fields(hf),
                   first_k_dense_replace=hf.first_k_dense_replace, attention_bias=hf.attention_bias,
                   use_qk_norm=hf.use_qk_norm)

    def moe_args(self) -> MoEArgs:
        return MoEArgs(num_experts=self.n_routed_experts, top_k=self.num_experts_per_tok, hidden_size=self.hidden_size,
                       intermediate_size=self.moe_intermediate_size, score_func="sigmoid",
                       norm_topk_prob=self.norm_topk_prob, n_group=self.n_group, topk_group=self.topk_group,
                       routed_scaling_factor=self.routed_scaling_factor, score_bias="router", router_fp32=True,
                       num_shared_experts=self.n_shared_experts)


def routing_fields(hf: Any) -> dict[str, Any]:
    """The feed-forward fields of `Glm4MoeArgs` from a transformers config object of GLM-4.5's routing (GLM-5 and
    DeepSeek-V3 route the same way), the expert groups checked."""
    groups_fit = hf.n_routed_experts % hf.n_group == 0 and (hf.n_group == 1 or hf.n_routed_experts // hf.n_group >= 2)
    if not groups_fit or not 1 <= hf.topk_group <= hf.n_group:
        raise UnsupportedConfig("n_group", hf.n_group, f"must split n_routed_experts = {hf.n_routed_experts} into groups "
                                f"of 2 or more experts and be at least topk_group = {hf.topk_group}")
    return dict(intermediate_size=hf.intermediate_size, moe_intermediate_size=hf.moe_intermediate_size,
                n_routed_experts=hf.n_routed_experts, n_shared_experts=hf.n_shared_experts,
                num_experts_per_tok=hf.num_experts_per_tok, n_group=hf.n_group, topk_group=hf.topk_group,
                routed_scaling_factor=float(hf.routed_scaling_factor), norm_topk_prob=hf.norm_topk_prob)


class Glm4MoeForCausalLM(DecoderLM):
    def __init__(self, args: Glm4MoeArgs):
        def layer(i: int, cls: type[DecoderLayer] = DecoderLayer) -> DecoderLayer:
            attention = Attention(args.hidden_size, args.num_attention_heads, args.num_key_value_heads, args.head_dim,
                                  args.rms_norm_eps, qkv_bias=args.attention_bias, o_bias=False,
                                  qk_norm="head" if args.use_qk_norm else "none")
            mlp: nn.Module = (MLP(args.hidden_size, args.intermediate_size) if i < args.first_k_dense_replace
                              else MoE(args.moe_args()))
            return cls(i, attention, mlp, args.hidden_size, args.rms_norm_eps)

        num_layers = args.num_hidden_layers
        super().__init__(args, [layer(i) for i in range(num_layers)],
                         [layer(num_layers + i, DraftHead) for i in range(args.num_nextn_predict_layers)])
