"""The pre-norm decoder block and causal LM every native family is built from.

A block is split at attention, and each half is a plain function of tensors:

    x -> before_attention (input norm, q/k/v projections, optional q/k norms, RoPE) -> q, k, v
      -> the attention backend (training kernels, paged KV cache, ...)
      -> after_attention (o projection, residual, post norm, the feed-forward, residual) -> x

`DecoderLayer.forward` calls these functions with its parameters, and the trainer compiles and
checkpoints the same functions (`tandem.trainer.block`), so the block's math exists once. The
feed-forward is the block's `mlp` module (`FeedForward`): dense SwiGLU (`layers.MLP`) or a
mixture of experts (`moe.MoE`); a new kind of feed-forward is one new module, nothing else.

Families differ only in settings of these parts: attention biases, q/k norms per head (Qwen3), over
all heads (MiniMax-M2) or none (GLM-4.5), partial rotary embeddings, which layers are sparse.
Single-device code: parallelism is applied from outside, per block in `layers`.

A model may hold multi-token prediction layers after its blocks (`model.mtp_layers`, `num_nextn_predict_layers`):
not part of `forward`, run by `predict_after_next` for a speculative draft, frozen unless the trainer trains them
(`tandem.trainer.mtp`). The decoder families' is `DraftHead` (`tandem model add-draft-head` gives a model one).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, ClassVar, Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tandem.models.attention import AttentionBackend, PackedCausalAttention
from tandem.models.layers import MLP, RMSNorm, YarnScaling, apply_rope, projection_weight, rms_norm, rope_cos_sin
from tandem.models.multi_token import MtpParts
from tandem.models.random_init import initial_value


@dataclass(kw_only=True)
class DecoderArgs:
    """Settings every family shares; each family's args add their own (read from config.json by `from_hf`)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    """Query heads (Hq)."""
    num_key_value_heads: int
    """Key/value heads (Hkv), shared by Hq / Hkv query heads each."""
    head_dim: int
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMS norm of the model."""
    rope_theta: float = 1_000_000.0
    rope_scaling: YarnScaling | None = None
    """YaRN scaling of RoPE (`rope_parameters.rope_type` = "yarn"); None: plain RoPE."""
    partial_rotary_factor: float = 1.0
    """Fraction of each head's features that RoPE rotates (the first ones)."""
    tie_word_embeddings: bool = False
    """The LM head is the embedding matrix."""
    max_position_embeddings: int = 40960
    num_nextn_predict_layers: int = 0
    """Multi-token prediction layers after the last block (`model.mtp_layers`): a speculative draft of the policy's
    own (`DraftHead` for the decoder families; GLM-5's and DeepSeek-V3's in `tandem.models.glm_moe_dsa`)."""

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


Linear = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
"""`F.linear`'s signature: (x, weight, bias) -> x @ weight.T + bias."""
Norm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
"""`layers.rms_norm`'s signature: (x, weight, eps)."""


class FeedForward(Protocol):
    """What a block's `mlp` is: a module mapping normed hidden states [B, T, hidden] to [B, T, hidden]."""

    tensor_function: ClassVar[Callable[..., torch.Tensor] | None]
    """`forward` as a function of (x, *self.tensor_args()) with shapes fixed by the input's, which
    callers may compile; None where shapes depend on the data (a mixture of experts routes tokens).
    Where it is set, the module also has `tensor_args()`: the tensors to pass after x."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


def before_attention(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm_weight: torch.Tensor,
                     wq: torch.Tensor, bq: torch.Tensor | None, wk: torch.Tensor, bk: torch.Tensor | None,
                     wv: torch.Tensor, bv: torch.Tensor | None, q_norm_weight: torch.Tensor | None,
                     k_norm_weight: torch.Tensor | None, eps: float, head_dim: int, linear: Linear = F.linear,
                     norm: Norm = rms_norm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [B, T, hidden] -> q [B, T, Hq, D], k and v [B, T, Hkv, D] (head counts from the weight shapes).

    A q/k norm weight of `head_dim` features normalizes each head; a longer one (MiniMax-M2)
    normalizes the whole projection, all heads together, before it is split into heads.
    `linear`, `norm`: how projections and norms are computed (exact mode passes batch-invariant kernels)."""
    h = norm(x, norm_weight, eps)
    q, k, v = linear(h, wq, bq), linear(h, wk, bk), linear(h, wv, bv)
    return normed_rotated(q, k, v, cos, sin, q_norm_weight, k_norm_weight, eps, head_dim, norm)


def normed_rotated(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None, eps: float, head_dim: int,
                   norm: Norm = rms_norm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The projections q [B, T, Hq * D], k and v [B, T, Hkv * D] -> q and k normed and rotated, split into heads
    like v: [B, T, heads, D]."""
    B, T, _ = q.shape
    if q_norm_weight is not None and q_norm_weight.shape[0] != head_dim:
        q, k = norm(q, q_norm_weight, eps), norm(k, k_norm_weight, eps)
    q, k, v = (t.view(B, T, -1, head_dim) for t in (q, k, v))
    if q_norm_weight is not None and q_norm_weight.shape[0] == head_dim:
        q, k = norm(q, q_norm_weight, eps), norm(k, k_norm_weight, eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def attention_residual(x: torch.Tensor, attended: torch.Tensor, wo: torch.Tensor, bo: torch.Tensor | None,
                       norm_weight: torch.Tensor, eps: float, linear: Linear = F.linear,
                       norm: Norm = rms_norm) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, T, hidden] and the attention output [B, T, Hq, D] -> (x + o_proj(attended), its post norm)."""
    B, T, _ = x.shape
    x = x + linear(attended.reshape(B, T, -1), wo, bo)
    return x, norm(x, norm_weight, eps)


def after_attention(x: torch.Tensor, attended: torch.Tensor, wo: torch.Tensor, bo: torch.Tensor | None,
                    norm_weight: torch.Tensor, eps: float, feed_forward: Callable[..., torch.Tensor],
                    *ffn_args: torch.Tensor, linear: Linear = F.linear, norm: Norm = rms_norm) -> torch.Tensor:
    """The block's second half: `attention_residual`, then x + feed_forward(norm, *ffn_args)."""
    x, h = attention_residual(x, attended, wo, bo, norm_weight, eps, linear, norm)
    return x + feed_forward(h, *ffn_args)


class Attention(nn.Module):
    """Projections and norms of grouped-query attention; the math is `before_attention`."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                 qkv_bias: bool, o_bias: bool, qk_norm: Literal["head", "all_heads", "none"]):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=o_bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if qk_norm != "none":
            q_dim, k_dim = (head_dim, head_dim) if qk_norm == "head" else (num_heads * head_dim, num_kv_heads * head_dim)
            self.q_norm, self.k_norm = RMSNorm(q_dim, eps), RMSNorm(k_dim, eps)


class PreNormBlock(nn.Module):
    """A pre-norm block's parts under Hugging Face's names: x + attention(norm(x)), then x + mlp(norm(x)); `mlp` is
    any `FeedForward`. `DecoderLayer` is the one split at attention; latent attention has its own
    (`tandem.models.glm_moe_dsa`)."""

    def __init__(self, layer_idx: int, attention: nn.Module, mlp: FeedForward, hidden_size: int, eps: float):
        super().__init__()
        self.layer_idx = layer_idx
        self.eps = eps
        self.self_attn = attention
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)


class DecoderLayer(PreNormBlock):
    """The block of grouped-query `Attention`, split at it: `before_attention`, the backend, `after_attention`."""

    def before_attention_args(self) -> tuple[torch.Tensor | None, ...]:
        """The tensors `before_attention` takes after (x, cos, sin), read now (FSDP swaps them)."""
        a = self.self_attn
        return (self.input_layernorm.weight, projection_weight(a.q_proj), a.q_proj.bias, projection_weight(a.k_proj),
                a.k_proj.bias, projection_weight(a.v_proj), a.v_proj.bias, a.q_norm.weight if a.q_norm is not None else None,
                a.k_norm.weight if a.k_norm is not None else None)

    def residual_args(self) -> tuple[torch.Tensor | None, ...]:
        """The tensors `attention_residual` takes after (x, attended)."""
        return projection_weight(self.self_attn.o_proj), self.self_attn.o_proj.bias, self.post_attention_layernorm.weight

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        q, k, v = before_attention(x, cos, sin, *self.before_attention_args(), self.eps, self.self_attn.head_dim)
        attended = backend.attend(self.layer_idx, q, k, v)
        return after_attention(x, attended, *self.residual_args(), self.eps, self.mlp)


class DraftHead(DecoderLayer, MtpParts):
    """The decoder families' multi-token prediction layer: `multi_token.MtpParts` around one `DecoderLayer` of the
    family's own attention with a dense SwiGLU feed-forward (GLM-4.5's checkpoints: its routed block), at layer
    index `num_hidden_layers` (the engine's paged cache holds its keys and values as one more layer). It reads the
    trunk's last hidden state only (not EAGLE-3's fusion of several layers' features): what the trunk already hands
    the LM head."""

    def __init__(self, layer_idx: int, attention: Attention, mlp: FeedForward, hidden_size: int, eps: float):
        super().__init__(layer_idx, attention, mlp, hidden_size, eps)
        self.add_mtp_parts(hidden_size, eps)

    def predict(self, hidden: torch.Tensor, next_embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                backend: AttentionBackend) -> torch.Tensor:
        """hidden [B, T, H] (the LM's output at t), next_embeds [B, T, H] (token t+1's embedding) -> the LM head's
        input [B, T, H] for token t+2. The block runs as `self.forward`, without forward hooks (see
        `glm_moe_dsa.MultiTokenPrediction.predict`): a forward the engine installs on it serves (FP8, fused blocks)."""
        return self.mtp_output(self.forward(self.mtp_input(hidden, next_embeds), cos, sin, backend))


def draft_heads(args: DecoderArgs, last: DecoderLayer) -> list[DraftHead]:
    """`args.num_nextn_predict_layers` draft heads after the blocks, each with attention shaped as the last
    block's (biases, q/k norms) and a dense SwiGLU of `intermediate_size` features."""
    return [DraftHead(args.num_hidden_layers + i, copy.deepcopy(last.self_attn), MLP(args.hidden_size, args.intermediate_size),
                      args.hidden_size, args.rms_norm_eps) for i in range(args.num_nextn_predict_layers)]


class DecoderModel(nn.Module):
    """Embeddings, blocks and final norm under Hugging Face's `model.` names."""

    def __init__(self, vocab_size: int, hidden_size: int, eps: float, layers: list[DecoderLayer]):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden_size, eps)


class DecoderLM(nn.Module):
    """A causal LM of `DecoderLayer`s; `forward` gives final hidden states [B, T, hidden].

    The caller applies `lm_head` where it needs logits (the engine on last tokens, the trainer in
    chunks), so full logits never exist unasked."""

    split_blocks: ClassVar[bool] = True
    """The blocks are `DecoderLayer`s, split at attention (`tandem.models.loading.has_split_blocks`)."""

    def __init__(self, args: DecoderArgs, layers: list[DecoderLayer], mtp_layers: list[nn.Module] | None = None):
        """`mtp_layers`: the multi-token prediction layers; None: `draft_heads` as `args` asks."""
        super().__init__()
        self.args = args
        self.model = DecoderModel(args.vocab_size, args.hidden_size, args.rms_norm_eps, layers)
        self.model.mtp_layers = nn.ModuleList(draft_heads(args, layers[-1]) if mtp_layers is None else mtp_layers)
        self.model.mtp_layers.requires_grad_(False)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention: AttentionBackend | None = None) -> torch.Tensor:
        """input_ids, position_ids [B, T] -> hidden [B, T, hidden]. Positions restart per document."""
        backend = attention if attention is not None else PackedCausalAttention(position_ids)
        h = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(position_ids, self.args.rotary_dim, self.args.rope_theta, h.dtype, self.args.rope_scaling)
        return self.model.norm(self.run_layers(h, cos, sin, backend))

    def run_layers(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        """The blocks in order. A method of its own so that the trainer can run them otherwise (all of them as one
        compiled graph: `tandem.trainer.stack`) without touching the model."""
        for layer in self.model.layers:
            h = layer(h, cos, sin, backend)
        return h

    def predict_after_next(self, hidden: torch.Tensor, next_ids: torch.Tensor, position_ids: torch.Tensor,
                           attention: AttentionBackend | None = None, depth: int = 0, detach_inputs: bool = False
                           ) -> torch.Tensor:
        """The MTP layer `depth`'s hidden state [B, T, hidden] for token t+2, from this model's output `hidden` at t
        and `next_ids` [B, T] (token t+1 of each position); logits through `lm_head`. `detach_inputs`: `hidden` and
        the embeddings enter without gradient, so a loss on the result trains the MTP layer alone."""
        hidden, embeds, cos, sin, backend = self.mtp_inputs(hidden, next_ids, position_ids, attention, detach_inputs)
        return self.model.mtp_layers[depth].predict(hidden, embeds, cos, sin, backend)

    def mtp_inputs(self, hidden: torch.Tensor, next_ids: torch.Tensor, position_ids: torch.Tensor,
                   attention: AttentionBackend | None, detach_inputs: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionBackend]:
        """What an MTP layer's `predict` takes: (hidden, the embeddings of `next_ids`, cos, sin, the backend)."""
        backend = attention if attention is not None else PackedCausalAttention(position_ids)
        embeds = self.model.embed_tokens(next_ids)
        if detach_inputs:
            hidden, embeds = hidden.detach(), embeds.detach()
        cos, sin = rope_cos_sin(position_ids, self.args.rotary_dim, self.args.rope_theta, hidden.dtype, self.args.rope_scaling)
        return hidden, embeds, cos, sin, backend

    def init_weights(self, seed: int = 0) -> None:
        """Random weights in place (`tandem.models.random_init`: values set by seed, name and device kind)."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(initial_value(name, p.shape, seed, p.device))  # copy_ rounds to p's dtype
