"""Model FLOPs of a training step, the numerator of MFU, counted two ways.

`model_flops`, the usual MFU count and the one benchmarks compare: 6 * P * tokens + attention,
P the ACTIVE parameters of the model (`active_params`: every parameter, a tied embedding once as
it is the LM head's matmul, except that a mixture-of-experts block counts only k of its E routed
experts, the ones each token goes through), as if the LM head ran on every token; it depends on
the model and the data only, not on the implementation.

`training_flops`, the work the trainer actually asks for:
flops = 6 * P_blocks * tokens + 6 * P_head * logprob_tokens + attention, where
- P_blocks counts the active matrix parameters of the transformer blocks (norms are negligible;
  the embedding lookup is no matmul; k of E routed experts), over every token of the step;
- P_head (vocab x hidden) counts once per token whose logprob is computed (the trainer runs the LM
  head only on loss tokens);
- attention: per causal sequence of length L and per layer, 2 L^2 Hq D in forward (QK^T and PV,
  each 2 L^2 Hq D halved by causality), 3x that with backward: 6 L^2 Hq D. Only the sequences
  actually in the rows count, so packing short samples lowers it (no cross-sample attention).
Recomputation by activation checkpointing is not counted (MFU, not hardware FLOPs utilization).
"""

from __future__ import annotations

from torch import nn

from tandem.trainer.parallel.expert_parallel import moe_blocks


def matrix_params(module: nn.Module) -> int:
    """Elements of the module's parameters with 2 or more dims (global size, also when sharded)."""
    return sum(p.numel() for p in module.parameters() if p.dim() >= 2)


def inactive_expert_params(blocks: nn.ModuleList) -> int:
    """Routed-expert parameters a token does not go through: (E - k) / E of each MoE block's experts."""
    total = 0
    for moe in moe_blocks(blocks):
        experts = sum(p.numel() for p in moe.experts.parameters())
        total += experts * (moe.args.num_experts - moe.args.top_k) // moe.args.num_experts
    return total


def active_params(lm: nn.Module) -> int:
    """Parameters each token goes through (global sizes, also when sharded); all of them for a dense model."""
    return sum(p.numel() for p in lm.parameters()) - inactive_expert_params(lm.layers)


def attention_flops(hf_config: dict, sequence_lengths: list[int]) -> float:
    """Forward and backward attention FLOPs of causal sequences: 6 * layers * Hq * D * L^2 each."""
    heads = hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // heads
    return float(6 * hf_config["num_hidden_layers"] * heads * head_dim * sum(n * n for n in sequence_lengths))


def model_flops(num_params: int, hf_config: dict, sequence_lengths: list[int]) -> float:
    """6 * P per token of the sequences, plus their attention."""
    return float(6 * num_params * sum(sequence_lengths)) + attention_flops(hf_config, sequence_lengths)


def training_flops(blocks: nn.Module, head_params: int, hf_config: dict, sequence_lengths: list[int], num_logprob_tokens: int) -> float:
    dense = 6 * (matrix_params(blocks) - inactive_expert_params(blocks)) * sum(sequence_lengths) + 6 * head_params * num_logprob_tokens
    return float(dense) + attention_flops(hf_config, sequence_lengths)
