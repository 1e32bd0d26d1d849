"""GLM-5 (`glm_moe_dsa`) and DeepSeek-V3 (`deepseek_v3`): multi-head latent attention and GLM-4.5's routing, with
DeepSeek sparse attention in GLM-5.

- attention: `mla.LatentAttention` (q and kv low-rank chains, the RoPE / no-RoPE split of each head); in GLM-5 each
  `full` layer of `indexer_types` has a DSA indexer (`dsa.Indexer`) choosing the `index_topk` tokens each query
  attends to, and each `shared` layer reuses the choice of the last `full` layer before it;
- feed-forward: the first `first_k_dense_replace` blocks dense SwiGLU, the others a `moe.MoE` routed as GLM-4.5's
  (sigmoid scores, score correction bias, groups, renormalized, scaled, shared experts: `Glm4MoeArgs.moe_args`);
- multi-token prediction: the `num_nextn_predict_layers` layers the checkpoints hold after the last block
  (`model.layers.{num_hidden_layers + i}`) are kept as `model.mtp_layers.{i}` (`MultiTokenPrediction`), loaded,
  published and reloaded with the rest (`tandem.models.expert_layout` renames them), not part of the causal LM's
  forward and frozen unless the trainer trains them (`tandem.trainer.mtp`): a speculative decoder can draft with them.

The blocks are not `decoder.DecoderLayer`s (their attention has projections of its own), so `has_split_blocks` is
false for these families: the trainer runs each block whole (no compiled halves; selective checkpointing falls back to
whole blocks), and the inference engine serves them through a `mla.LatentBackend` (its paged latent cache), to which
a block hands its projections rather than expanded keys and values; the trainer's context parallelism is another
(`tandem.trainer.parallel.latent_context_parallel`). Exact mode (`[run] exact`) replaces the block's forward by
`tandem.models.exact_latent`'s, token by token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tandem.models.attention import AttentionBackend, PackedCausalAttention
from tandem.models.decoder import DecoderLM, PreNormBlock, after_attention
from tandem.models.dsa import Chosen, Indexer, SparseContext, chosen, sparse_context
from tandem.models.glm4_moe import Glm4MoeArgs, routing_fields
from tandem.models.hf_config import UnsupportedConfig, decoder_fields, expect, transformers_config
from tandem.models.layers import MLP, projection_weight, rms_norm, rope_cos_sin
from tandem.models.mla import LatentAttention, LatentBackend, LatentProjections
from tandem.models.moe import MoE
from tandem.models.multi_token import MtpParts


DSA_LAYER_TYPES = ("indexed_attention", "deepseek_sparse_attention")
"""GLM-5's attention layer as `layer_types` names it: older transformers configs write the second name for the
same layer (MLA with a DSA indexer), newer ones the first; both must load."""


@dataclass(kw_only=True)
class LatentMoeArgs(Glm4MoeArgs):
    """GLM-4.5's settings (`head_dim` is Dn + Dr and there are as many key/value heads as query heads, MLA's
    expanded form; `use_qk_norm` stays off) plus MLA's, DSA's and the multi-token prediction layers'."""

    q_lora_rank: int | None
    """Rank of the query chain; None: a full `q_proj` (DeepSeek-V2-Lite's shape)."""
    kv_lora_rank: int
    qk_nope_head_dim: int
    """Dn: features of each q/k head that RoPE leaves alone."""
    qk_rope_head_dim: int
    """Dr: features of each q/k head that RoPE turns (the last ones of a head), also the indexer's first Dr."""
    v_head_dim: int
    softmax_scale: float
    """Of the attention logits: 1 / sqrt(Dn + Dr), larger under DeepSeek-V3's YaRN (`softmax_scale`)."""
    rope_interleave: bool = True
    """RoPE on interleaved pairs (the checkpoints' layout) rather than on the two halves."""
    index_topk: int = 0
    """DSA: tokens each query attends to at most."""
    index_n_heads: int = 0
    index_head_dim: int = 0
    indexer_types: list[str] = field(default_factory=list)
    """DSA: "full" (its own indexer) or "shared" (the last full layer's selection) per block; empty: dense MLA."""

    @property
    def rotary_dim(self) -> int:
        return self.qk_rope_head_dim

    @property
    def has_dsa(self) -> bool:
        return bool(self.indexer_types)


def latent_moe_fields(hf: Any, layer_types: tuple[str, ...], first_dense: int) -> dict[str, Any]:
    """The `LatentMoeArgs` fields GLM-5 and DeepSeek-V3 share, from a transformers config object, after the checks."""
    fields = decoder_fields(hf, layer_types)
    expect(fields, "partial_rotary_factor", (1.0,))
    expect(hf, "num_key_value_heads", (hf.num_attention_heads,))  # MLA expands k and v to every query head
    expect(hf, "mlp_bias", (False,), False)
    expect(hf, "scoring_func", ("sigmoid",), "sigmoid")
    expect(hf, "topk_method", ("noaux_tc",), "noaux_tc")
    expect(hf, "moe_layer_freq", (1,), 1)
    qk_head_dim = hf.qk_nope_head_dim + hf.qk_rope_head_dim
    return dict(fields, head_dim=qk_head_dim, num_key_value_heads=hf.num_attention_heads, **routing_fields(hf),
                first_k_dense_replace=first_dense, attention_bias=hf.attention_bias, q_lora_rank=hf.q_lora_rank,
                kv_lora_rank=hf.kv_lora_rank, qk_nope_head_dim=hf.qk_nope_head_dim, qk_rope_head_dim=hf.qk_rope_head_dim,
                v_head_dim=hf.v_head_dim, softmax_scale=softmax_scale(hf.rope_parameters or {}, qk_head_dim))


def softmax_scale(rope: dict[str, Any], qk_head_dim: int) -> float:
    """1 / sqrt(Dn + Dr), times mscale(factor, mscale_all_dim)^2 for a scaled RoPE that sets `mscale_all_dim`
    (DeepSeek-V3's YaRN: the logits' scale grows with the context factor; transformers' `yarn_apply_mscale`)."""
    scale = qk_head_dim ** -0.5
    m = rope.get("mscale_all_dim") if rope.get("rope_type", "default") != "default" else None
    if m and rope["factor"] > 1:
        scale *= (0.1 * m * math.log(rope["factor"]) + 1.0) ** 2
    return scale


class GlmMoeDsaArgs(LatentMoeArgs):
    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "GlmMoeDsaArgs":
        """Read a GLM-5 `config.json`, including the released file's fields transformers' class does not declare;
        unsupported values raise `UnsupportedConfig`."""
        hf = transformers_config(config)
        expect(hf, "rope_interleave", (True,), True)  # transformers' GLM-5 always interleaves
        expect(hf, "indexer_rope_interleave", (True,), True)  # DeepSeek-V3.2's half-split indexer RoPE is not GLM-5's
        if hf.q_lora_rank is None:
            raise UnsupportedConfig("q_lora_rank", None, "GLM-5's indexer reads the query latent: a rank is needed")
        types = list(hf.indexer_types)
        if len(types) != hf.num_hidden_layers or any(t not in ("full", "shared") for t in types) or types[0] != "full":
            raise UnsupportedConfig("indexer_types", types, f"'full' or 'shared' for each of the {hf.num_hidden_layers} "
                                    "layers, the first 'full' (a 'shared' layer reuses the selection of a 'full' one before it)")
        if not 1 <= hf.index_topk or not hf.qk_rope_head_dim <= hf.index_head_dim:
            raise UnsupportedConfig("index_head_dim", hf.index_head_dim, f"at least qk_rope_head_dim = {hf.qk_rope_head_dim}, "
                                    f"with index_topk = {hf.index_topk} at least 1")
        mlp_types = list(hf.mlp_layer_types)
        first_dense = mlp_types.count("dense")
        if mlp_types != ["dense"] * first_dense + ["sparse"] * (len(mlp_types) - first_dense) or len(mlp_types) != hf.num_hidden_layers:
            raise UnsupportedConfig("mlp_layer_types", mlp_types, "'dense' blocks first, then 'sparse' ones, one per layer")
        return cls(**latent_moe_fields(hf, DSA_LAYER_TYPES, first_dense), rope_interleave=True,
                   index_topk=hf.index_topk, index_n_heads=hf.index_n_heads, index_head_dim=hf.index_head_dim,
                   indexer_types=types)


class DeepseekV3Args(LatentMoeArgs):
    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "DeepseekV3Args":
        """Read a DeepSeek-V3 `config.json` (MLA without DSA); unsupported values raise `UnsupportedConfig`."""
        hf = transformers_config(config)
        return cls(**latent_moe_fields(hf, ("full_attention",), hf.first_k_dense_replace), rope_interleave=hf.rope_interleave)


class LatentAttentionBlock(PreNormBlock):
    """Pre-norm block around `LatentAttention`: x + o_proj(attention(norm(x))), then `decoder.after_attention`'s
    x + mlp(norm(x)). Between layers it passes the DSA selection on (`forward`'s second output)."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend,
                sparse: SparseContext | None = None, selection: Chosen | None = None
                ) -> tuple[torch.Tensor, Chosen | None]:
        """x [B, T, hidden] -> (x after the block, the DSA selection the next `shared` layer reuses).

        `sparse`: None attends densely through `backend` (no DSA, or no query sees more than `index_topk` tokens);
        else a full layer selects with its indexer and a shared one uses `selection`. A `LatentBackend` (the engine's
        latent cache, the trainer's context-parallel gather) is handed the layer's projections and selects itself: `sparse` is None and `selection` is its
        own form."""
        attended, selection = self.attention_output(x, cos, sin, backend, sparse, selection)
        attention = self.self_attn
        x = after_attention(x, attended, projection_weight(attention.o_proj), attention.o_proj.bias,
                            self.post_attention_layernorm.weight, self.eps, self.mlp)
        return x, selection

    def attention_output(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend,
                         sparse: SparseContext | None, selection: Chosen | None
                         ) -> tuple[torch.Tensor, Chosen | None]:
        """The block's attention before o_proj, [B, T, H, Dv], and the selection `forward` passes on (its
        arguments). Apart from `forward` so that the engine's FP8 block (`tandem.inference.engine.fp8_blocks`)
        computes the same attention and takes over from o_proj on."""
        attention = self.self_attn
        h = rms_norm(x, self.input_layernorm.weight, self.eps)
        projections = attention.project_latent(h, cos, sin)
        if isinstance(backend, LatentBackend):  # it keeps the latents, selects and attends itself
            indexer = attention.indexer
            index = indexer.project(h, projections.query_latent, cos, sin) if indexer is not None else None
            return backend.attend_latent(self.layer_idx, attention, projections, index, selection)
        return self.attend(h, projections, cos, sin, backend, sparse, selection)

    def attend(self, h: torch.Tensor, projections: LatentProjections, cos: torch.Tensor, sin: torch.Tensor,
               backend: AttentionBackend, sparse: SparseContext | None, selection: Chosen | None
               ) -> tuple[torch.Tensor, Chosen | None]:
        """Attention through a backend of expanded keys and values where every visible token is attended, else over
        each query's chosen entries in the absorbed form: [B, T, H, Dv] and the selection."""
        attention = self.self_attn
        if sparse is None:
            q = attention.queries(projections.q_nope, projections.q_rope)
            k, v = attention.keys_values(projections.entries)
            return backend.attend(self.layer_idx, q, k, v), selection
        if attention.indexer is not None:
            index = attention.indexer.project(h, projections.query_latent, cos, sin)
            selection = chosen(index, index.keys, sparse.visible, sparse.index_topk)
        elif selection is None:
            raise ValueError(f"layer {self.layer_idx} shares the DSA selection of an earlier layer, but none came before")
        return attention.attend_chosen(projections.q_nope, projections.q_rope, projections.entries, selection.positions,
                                       selection.kept), selection


def latent_block(args: LatentMoeArgs, layer_idx: int, sparse: bool, indexed: bool, cls: type = LatentAttentionBlock) -> nn.Module:
    """Block `layer_idx` (a `cls`): an MoE feed-forward where `sparse`, a DSA indexer where `indexed`."""
    indexer = (Indexer(args.hidden_size, args.q_lora_rank, args.index_n_heads, args.index_head_dim, args.qk_rope_head_dim,
                       args.rope_interleave) if indexed else None)
    attention = LatentAttention(args.hidden_size, args.num_attention_heads, args.q_lora_rank, args.kv_lora_rank,
                                args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim, args.attention_bias,
                                args.softmax_scale, args.rope_interleave, indexer)
    mlp = MoE(args.moe_args()) if sparse else MLP(args.hidden_size, args.intermediate_size)
    return cls(layer_idx, attention, mlp, args.hidden_size, args.rms_norm_eps)


class MultiTokenPrediction(LatentAttentionBlock, MtpParts):
    """One multi-token prediction layer (DeepSeek-V3's MTP, as GLM-5 ships it): `multi_token.MtpParts` around a
    latent block of its own (its own MLA, indexer and MoE)."""

    def __init__(self, layer_idx: int, attention: LatentAttention, mlp: nn.Module, hidden_size: int, eps: float):
        super().__init__(layer_idx, attention, mlp, hidden_size, eps)
        self.add_mtp_parts(hidden_size, eps)

    def predict(self, hidden: torch.Tensor, next_embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                backend: AttentionBackend, sparse: SparseContext | None) -> torch.Tensor:
        """hidden [B, T, hidden] (the LM's output at t), next_embeds [B, T, hidden] (token t+1's embedding) -> the
        normed hidden state [B, T, hidden] that predicts token t+2.

        The block runs as a plain method, without the module's forward hooks: a trainer that shards this layer
        registers `predict` as its forward (`tandem.trainer.mtp`), which gathers the parameters once for all of it.
        It is `self.forward`, so that a forward installed on this layer serves (the engine's FP8 block)."""
        x = self.mtp_input(hidden, next_embeds)
        return self.mtp_output(self.forward(x, cos, sin, backend, sparse)[0])


class LatentMoeForCausalLM(DecoderLM):
    """GLM-5 or DeepSeek-V3 (`LatentMoeArgs`); `layers` are `LatentAttentionBlock`s."""

    split_blocks = False

    def __init__(self, args: LatentMoeArgs):
        num_layers = args.num_hidden_layers
        mtp = [latent_block(args, num_layers + i, True, args.has_dsa, MultiTokenPrediction)
               for i in range(args.num_nextn_predict_layers)]
        super().__init__(args, [latent_block(args, i, i >= args.first_k_dense_replace,
                                             args.has_dsa and args.indexer_types[i] == "full") for i in range(num_layers)],
                         mtp)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention: AttentionBackend | None = None) -> torch.Tensor:
        """input_ids, position_ids [B, T] -> hidden [B, T, hidden]. Positions restart per document."""
        backend = attention if attention is not None else PackedCausalAttention(position_ids)
        h = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(position_ids, self.args.rotary_dim, self.args.rope_theta, h.dtype, self.args.rope_scaling)
        return self.model.norm(self.run_layers(h, cos, sin, backend, self.sparse_context(position_ids, backend)))

    def sparse_context(self, position_ids: torch.Tensor, backend: AttentionBackend | None = None) -> SparseContext | None:
        """The DSA context of a packed row; None without DSA or for a `LatentBackend`, which selects over the entries
        it holds."""
        if not self.args.has_dsa or isinstance(backend, LatentBackend):
            return None
        return sparse_context(position_ids, self.args.index_topk)

    def run_layers(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend,
                   sparse: SparseContext | None = None) -> torch.Tensor:
        """The blocks in order, each `shared` layer handed the DSA selection before it, a `full` one none: it
        chooses its own, and a selection handed to a checkpointed block stays alive until that block's backward."""
        selection = None
        for layer in self.model.layers:
            handed = None if layer.self_attn.indexer is not None else selection
            h, selection = layer(h, cos, sin, backend, sparse, handed)
        return h

    def predict_after_next(self, hidden: torch.Tensor, next_ids: torch.Tensor, position_ids: torch.Tensor,
                           attention: AttentionBackend | None = None, depth: int = 0, detach_inputs: bool = False
                           ) -> torch.Tensor:
        """`DecoderLM.predict_after_next`, the layer's DSA selecting over its own index keys."""
        hidden, embeds, cos, sin, backend = self.mtp_inputs(hidden, next_ids, position_ids, attention, detach_inputs)
        return self.model.mtp_layers[depth].predict(hidden, embeds, cos, sin, backend, self.sparse_context(position_ids, backend))
