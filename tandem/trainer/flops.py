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

Multi-head latent attention (GLM-5, DeepSeek-V3) counts in the expanded form, the model's own math: QK^T over the
query/key heads' Dn + Dr dims and PV over the value heads' Dv, so a causal pair costs 2 Hq (Dn + Dr + Dv) forward
(2 Hq 2D for D-dim heads: the formula above). DSA layers compute the absorbed form over their chosen entries
(`tandem.models.chosen_attention`), whose wider products per pair are not counted (MFU, as for recomputation). DeepSeek sparse attention (GLM-5) attends each query to at most `index_topk`
tokens: a sequence of L > k tokens has k^2 / 2 + (L - k) k attended pairs instead of L^2 / 2. Its indexers (the
`full` layers') run forward only (no_grad, frozen): 2 FLOPs per parameter and token for their projections and
2 * index_n_heads * index_head_dim per visible pair for their scores, counted apart from P, which leaves them out.
"""

from __future__ import annotations

from torch import nn

from tandem.models.dsa import Indexer
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


def indexer_params(module: nn.Module, matrices_only: bool = False) -> int:
    """Parameters of the module's DSA indexers, which run forward only (`tandem.models.dsa.Indexer`)."""
    indexers = [m for m in module.modules() if isinstance(m, Indexer)]
    return sum(matrix_params(m) if matrices_only else sum(p.numel() for p in m.parameters()) for m in indexers)


def active_params(lm: nn.Module) -> int:
    """Parameters each token goes through forward and backward (global sizes, also when sharded): all of them for a
    dense model, but DSA's indexers (forward only: `indexer_flops`)."""
    return sum(p.numel() for p in lm.parameters()) - inactive_expert_params(lm.layers) - indexer_params(lm)


def attended_pairs(length: int, index_topk: int | None) -> float:
    """Query-key pairs of a causal sequence (L^2 / 2), each query keeping at most `index_topk` keys (DSA)."""
    if index_topk is None or length <= index_topk:
        return length * length / 2
    return index_topk * index_topk / 2 + (length - index_topk) * index_topk


def attention_flops(hf_config: dict, sequence_lengths: list[int]) -> float:
    """Forward and backward attention FLOPs of causal sequences: 3 * 2 * Hq * (Dqk + Dv) per attended pair and
    layer (6 * Hq * D * L^2 a sequence for D-dim heads and every pair)."""
    heads = hf_config["num_attention_heads"]
    if hf_config.get("kv_lora_rank"):  # latent attention, expanded: query/key heads of Dn + Dr, value heads of Dv
        qk_dim, v_dim = hf_config["qk_nope_head_dim"] + hf_config["qk_rope_head_dim"], hf_config["v_head_dim"]
    else:
        qk_dim = v_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // heads
    topk = hf_config.get("index_topk") if hf_config.get("indexer_types") else None
    pairs = sum(attended_pairs(n, topk) for n in sequence_lengths)
    return 6 * hf_config["num_hidden_layers"] * heads * (qk_dim + v_dim) * pairs + indexer_flops(hf_config, sequence_lengths)


def indexer_flops(hf_config: dict, sequence_lengths: list[int]) -> float:
    """Forward FLOPs of DSA's indexers (those of the `full` layers of `indexer_types`): their projections (query
    from the query latent, key and head weights from the block's input) on every token, their scores on every
    visible pair; none without DSA."""
    full = sum(kind == "full" for kind in hf_config.get("indexer_types") or [])
    if not full:
        return 0.0
    heads, dim, hidden = hf_config["index_n_heads"], hf_config["index_head_dim"], hf_config["hidden_size"]
    params = hf_config["q_lora_rank"] * heads * dim + hidden * dim + hidden * heads
    tokens = sum(sequence_lengths)
    pairs = sum(attended_pairs(n, None) for n in sequence_lengths)
    return float(full * (2 * params * tokens + 2 * heads * dim * pairs))


def model_flops(num_params: int, hf_config: dict, sequence_lengths: list[int]) -> float:
    """6 * P per token of the sequences, plus their attention."""
    return float(6 * num_params * sum(sequence_lengths)) + attention_flops(hf_config, sequence_lengths)


def training_flops(blocks: nn.Module, head_params: int, hf_config: dict, sequence_lengths: list[int], num_logprob_tokens: int) -> float:
    block_params = matrix_params(blocks) - inactive_expert_params(blocks) - indexer_params(blocks, matrices_only=True)
    dense = 6 * block_params * sum(sequence_lengths) + 6 * head_params * num_logprob_tokens
    return float(dense) + attention_flops(hf_config, sequence_lengths)
