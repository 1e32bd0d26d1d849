"""Model FLOPs of a training step, the numerator of MFU.

flops = 6 * P_blocks * tokens + 6 * P_head * logprob_tokens + attention, where
- P_blocks counts the matrix parameters of the transformer blocks (norms are negligible; the
  embedding lookup is no matmul), over every token of the step;
- P_head (vocab x hidden) counts once per token whose logprob is computed (the trainer runs the LM
  head only on loss tokens);
- attention: per causal sequence of length L and per layer, 2 L^2 Hq D in forward (QK^T and PV,
  each 2 L^2 Hq D halved by causality), 3x that with backward: 6 L^2 Hq D. Only the sequences
  actually in the rows count, so packing short samples lowers it (no cross-sample attention).
Recomputation by activation checkpointing is not counted (MFU, not hardware FLOPs utilization).
"""

from __future__ import annotations

from torch import nn


def matrix_params(module: nn.Module) -> int:
    """Elements of the module's parameters with 2 or more dims (global size, also when sharded)."""
    return sum(p.numel() for p in module.parameters() if p.dim() >= 2)


def training_flops(blocks: nn.Module, head_params: int, hf_config: dict, sequence_lengths: list[int], num_logprob_tokens: int) -> float:
    heads = hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // heads
    layers = hf_config["num_hidden_layers"]
    tokens = sum(sequence_lengths)
    dense = 6 * matrix_params(blocks) * tokens + 6 * head_params * num_logprob_tokens
    attention = 6 * layers * heads * head_dim * sum(n * n for n in sequence_lengths)
    return float(dense + attention)
