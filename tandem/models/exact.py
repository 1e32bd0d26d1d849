"""Batch-invariant computation, for `[run] exact = true`: a token's numbers never depend on its neighbours.

The engine computes a token inside whatever batch the scheduler formed (prefill chunks beside decodes,
other sequences); the trainer computes it inside a packed row. Ordinary kernels pick reduction orders,
and vector or scalar code paths for transcendental functions, from the shapes they are given, so the same
token gets different roundings. Exact mode has two paths, and engine and trainer pick the same one, by
the same rule, for each operation:

- kernels (CUDA with Triton, or Triton's interpreter on the CPU; a dense model's blocks): the engine's
  fused block (`exact_kernel_block`): every matmul through `batch_invariant.linear` (fixed tiles, a row's
  reduction independent of the other rows; q, k, v as one stacked matmul, gate and up as another), the
  norms with their residual adds, the q/k norms with RoPE, and silu(gate) * up through `pointwise`
  (one program per row or token, a launch configuration fixed by the model's widths), attention through
  `attention_kernel.attend_each_token` (each query token a decode query of its own over fixed 512-key
  chunks: the engine's paged cache, or the trainer's packed keys seen as pages), log_softmax(logits / T)
  one program per row. The trainer calls the same kernels forward and differentiates through the model's
  own formulas. All of it runs inside the engine's CUDA graphs.
- token by token (the CPU, and a mixture of experts everywhere): blocks `before_attention` and
  `after_attention` one token at a time on [1, 1, hidden] tensors (`exact_block_forward`), the final
  norm likewise, attention by `exact_attention` (one query token against exactly its context keys,
  [context, heads, dim]), the head and log_softmax one row at a time. One kernel call per token and
  operation: for checking and small runs.

Latent attention blocks (GLM-5, DeepSeek-V3) take a path of their own, token by token in torch on every device,
one form of attention on both sides (`exact_latent`); the final norm and the head take the rules above.

Both processes install it with `apply_exact` and pass `exact=True` to their attention backend and head
(the engine's sampler computes its logprobs with `exact_log_softmax` too). Tested bitwise on the CPU in
fp32, dense, mixture-of-experts and latent attention models, both paths (`tests/trainer/test_exact_parity.py`);
on the GPU in bf16 by the CUDA cases of that test.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tandem.kernels import attention as attention_kernel, batch_invariant, pointwise
from tandem.kernels.batch_invariant import needs_grad
from tandem.models.attention import AttentionBackend, CachedAttention, DocumentCausalAttention
from tandem.models.decoder import DecoderLayer, after_attention, before_attention, normed_rotated
from tandem.models.exact_attention import exact_attention
from tandem.models.exact_latent import TokenContext, exact_latent_block_forward
from tandem.models.glm_moe_dsa import LatentAttentionBlock
from tandem.models.layers import MLP, RMSNorm, projection_weight, rms_norm
from tandem.models.stacked_projections import SharedInputProjections, concatenated_projections, stack_projections

def block_uses_kernels(block: DecoderLayer, device: torch.device) -> bool:
    """The kernel path for this block here: Triton runs on `device` and the feed-forward is dense (a mixture of
    experts routes token by token)."""
    return batch_invariant.is_available(device) and isinstance(block.mlp, MLP)


def attention_uses_kernels(device: torch.device, head_dim: int) -> bool:
    """The kernel path for attention here."""
    return batch_invariant.is_available(device) and attention_kernel.supports_head_dim(head_dim)


def model_uses_kernels(lm: nn.Module, device: torch.device) -> bool:
    """Every part of `lm` on the kernel path here, so its forward can be captured in a CUDA graph (no host
    lengths, no data-dependent shapes). Never for latent attention blocks (`exact_latent`: torch, token by token)."""
    return (all(isinstance(block, DecoderLayer) and block_uses_kernels(block, device) for block in lm.layers)
            and attention_uses_kernels(device, lm.layers[0].self_attn.head_dim))


def exact_block_forward(block: DecoderLayer, stacked: SharedInputProjections | None, x: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
    """`block.forward` batch-invariantly (x [B, T, hidden]): the kernel path, or every token computed alone.
    `stacked`: the engine's projections stacked once; None: concatenated at each forward (the trainer's)."""
    if block_uses_kernels(block, x.device):
        return exact_kernel_block(block, stacked or concatenated_projections(block), x, cos, sin, backend)
    eps, head_dim = block.eps, block.self_attn.head_dim
    args = block.before_attention_args()
    parts = [before_attention(x[:, t:t + 1], cos[:, t:t + 1], sin[:, t:t + 1], *args, eps, head_dim) for t in range(x.shape[1])]
    q, k, v = (torch.cat(p, dim=1) for p in zip(*parts))
    attended = backend.attend(block.layer_idx, q, k, v)
    residual = block.residual_args()
    return torch.cat([after_attention(x[:, t:t + 1], attended[:, t:t + 1], *residual, eps, block.mlp)
                      for t in range(x.shape[1])], dim=1)


def exact_kernel_block(block: DecoderLayer, stacked: SharedInputProjections, x: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
    """A dense block on the kernel path, the same calls in engine and trainer; every kernel computes a row (a
    token) by one program whose configuration depends on the model's widths only. Where the backend keeps a
    cache it reads from (the engine's), the q/k kernel writes keys and values into their slots directly."""
    B, T, hidden = x.shape
    eps, head_dim, layer_idx = block.eps, block.self_attn.head_dim, block.layer_idx
    norm_weight, *_, q_norm_weight, k_norm_weight = block.before_attention_args()
    x_ND, cos_NR, sin_NR = x.reshape(B * T, hidden), cos.reshape(B * T, -1), sin.reshape(B * T, -1)
    q, k, v = batch_invariant.linear(residual_norm(x_ND, None, norm_weight, eps), stacked.qkv,
                                     stacked.qkv_bias).split(stacked.qkv_sizes, dim=-1)
    if isinstance(backend, CachedAttention) and backend.reads_only_the_cache(head_dim, x.device):
        q_NHD = pointwise.qk_norm_rope_write(q, k, v, cos_NR, sin_NR, q_norm_weight, k_norm_weight, eps,
                                                 *backend.cache_slots(layer_idx))
        attended = backend.attend_cached(layer_idx, q_NHD)
    else:
        q, k, v = normed_rotated_tokens(q, k, v, cos_NR, sin_NR, q_norm_weight, k_norm_weight, eps, head_dim)
        attended = backend.attend(layer_idx, *(t.view(B, T, -1, head_dim) for t in (q, k, v)))
    wo, bo, post_norm_weight = block.residual_args()
    x_ND, h = residual_norm(x_ND, batch_invariant.linear(attended.reshape(B * T, -1), wo, bo), post_norm_weight, eps)
    hidden_ND = silu_mul(batch_invariant.linear(h, stacked.gate_up))
    return (x_ND + batch_invariant.linear(hidden_ND, projection_weight(block.mlp.down_proj))).view(B, T, hidden)


def residual_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """`pointwise.rms_norm` of x [N, hidden], differentiable through `layers.rms_norm`: its norm, or, with
    `delta` (the residual add), (x + delta, its norm)."""
    if needs_grad(x, weight, delta):
        return _ResidualNorm.apply(x, weight, eps, delta)
    total, normed = pointwise.rms_norm(x, weight, eps, delta)
    return (total, normed) if delta is not None else normed


class _ResidualNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, delta):
        ctx.save_for_backward(x, weight, delta)
        ctx.eps = eps
        total, normed = pointwise.rms_norm(x, weight, eps, delta)
        return (total, normed) if delta is not None else normed

    @staticmethod
    def backward(ctx, *grads):
        x, weight, delta = ctx.saved_tensors
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_() for t in (x, weight, delta) if t is not None]
            total = inputs[0] + inputs[2] if delta is not None else inputs[0]
            normed = rms_norm(total, inputs[1], ctx.eps)
            got = torch.autograd.grad((total, normed) if delta is not None else (normed,), inputs, grads)
        return got[0], got[1], None, got[2] if delta is not None else None


def normed_rotated_tokens(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None, eps: float,
                          head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`decoder.normed_rotated` of tokens (q [N, Hq * D], k, v [N, Hkv * D], cos, sin [N, R]) by the engine's
    kernel, which writes keys and values into a cache, here fresh tensors: [N, heads, D] each."""
    if needs_grad(q, k, v, q_norm_weight, k_norm_weight):
        return _NormedRotated.apply(q, k, v, cos, sin, q_norm_weight, k_norm_weight, eps, head_dim)
    return _normed_rotated_forward(q, k, v, cos, sin, q_norm_weight, k_norm_weight, eps, head_dim)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`pointwise.silu_mul` (gate_up [N, 2 * I] -> silu(gate) * up), differentiable through `F.silu`."""
    return _SiluMul.apply(gate_up) if needs_grad(gate_up) else pointwise.silu_mul(gate_up)


def _normed_rotated_forward(q, k, v, cos, sin, q_norm_weight, k_norm_weight, eps, head_dim):
    N, num_kv_heads = q.shape[0], k.shape[1] // head_dim
    k_out, v_out = (k.new_empty(N, 1, num_kv_heads, head_dim) for _ in range(2))
    q_out = pointwise.qk_norm_rope_write(q, k, v, cos, sin, q_norm_weight, k_norm_weight, eps, k_out, v_out,
                                             torch.arange(N, device=q.device))
    return q_out, k_out.view(N, num_kv_heads, head_dim), v_out.view(N, num_kv_heads, head_dim)


class _NormedRotated(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, cos, sin, q_norm_weight, k_norm_weight, eps, head_dim):
        ctx.save_for_backward(q, k, cos, sin, q_norm_weight, k_norm_weight)
        ctx.eps, ctx.head_dim = eps, head_dim
        return _normed_rotated_forward(q, k, v, cos, sin, q_norm_weight, k_norm_weight, eps, head_dim)

    @staticmethod
    def backward(ctx, grad_q, grad_k, grad_v):
        q, k, cos, sin, q_norm_weight, k_norm_weight = ctx.saved_tensors
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_() if t is not None else None for t in (q, k, q_norm_weight, k_norm_weight)]
            q_ref, k_ref, _ = normed_rotated(inputs[0][None], inputs[1][None], k[None], cos[None], sin[None],
                                             inputs[2], inputs[3], ctx.eps, ctx.head_dim)  # (v: its values unused)
            wanted = [t for t in inputs if t is not None]
            got = iter(torch.autograd.grad((q_ref, k_ref), wanted, (grad_q[None], grad_k[None])))
            grad_q_in, grad_k_in, grad_qw, grad_kw = (next(got) if t is not None else None for t in inputs)
        return grad_q_in, grad_k_in, grad_v.reshape(grad_v.shape[0], -1), None, None, grad_qw, grad_kw, None, None


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up):
        ctx.save_for_backward(gate_up)
        return pointwise.silu_mul(gate_up)

    @staticmethod
    def backward(ctx, grad):
        (gate_up,) = ctx.saved_tensors
        with torch.enable_grad():
            gate_up = gate_up.detach().requires_grad_()
            gate, up = gate_up.chunk(2, dim=-1)
            return torch.autograd.grad(F.silu(gate) * up, gate_up, grad)[0]


def exact_norm_forward(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """The final norm, by the kernel or one token at a time (x [1, N, hidden])."""
    if batch_invariant.is_available(x.device):
        return batch_invariant.rms_norm(x, norm.weight, norm.eps)
    return torch.cat([rms_norm(x[:, t:t + 1], norm.weight, norm.eps) for t in range(x.shape[1])], dim=1)


def apply_exact(lm: nn.Module, stack: bool = False) -> None:
    """Give a native causal LM (`tandem.models.decoder.DecoderLM`) the batch-invariant forward, in place: decoder
    blocks by `exact_block_forward`, latent attention blocks by `exact_latent.exact_latent_block_forward`.
    `stack` (the engine): each kernel-path block's projections stacked once, its parameters made views of them."""
    for block in lm.layers:
        if isinstance(block, LatentAttentionBlock):
            block.forward = functools.partial(exact_latent_block_forward, block, lm.args.index_topk)
            continue
        if not isinstance(block, DecoderLayer):
            raise TypeError(f"exact mode needs tandem's decoder or latent attention blocks, got {type(block).__name__}")
        with torch.no_grad():
            stacked = stack_projections(block) if stack and block_uses_kernels(block, lm.lm_head.weight.device) else None
        block.forward = functools.partial(exact_block_forward, block, stacked)
    lm.model.norm.forward = functools.partial(exact_norm_forward, lm.model.norm)


def exact_causal_attention(q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor, num_cached: int = 0,
                           k_cached: torch.Tensor | None = None, v_cached: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of T consecutive tokens of one sequence, after `num_cached` earlier ones whose keys and
    values are `k_cached`, `v_cached` [num_cached, Hkv, D]: [T, H, D], each token by `exact_attention`."""
    if num_cached:
        k_THD, v_THD = torch.cat([k_cached, k_THD]), torch.cat([v_cached, v_THD])
    return torch.stack([exact_attention(q_THD[t], k_THD[:num_cached + t + 1], v_THD[:num_cached + t + 1])
                        for t in range(q_THD.shape[0])])


def exact_logits(hidden_ND: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The LM head, by the kernel or one row at a time: [N, V] in the weight's dtype."""
    if batch_invariant.is_available(hidden_ND.device):
        return batch_invariant.linear(hidden_ND, weight, bias)
    rows = [F.linear(hidden_ND[i:i + 1], weight, bias) for i in range(hidden_ND.shape[0])]
    return torch.cat(rows) if rows else hidden_ND.new_empty(0, weight.shape[0], dtype=weight.dtype)


def exact_logprobs(logits_V: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits / T) of one row in fp32 (T: a 0-d fp32 tensor), as both sides compute it."""
    return (logits_V.float()[None] / temperature).log_softmax(-1)[0]


def exact_log_softmax(logits_NV: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits / T) [N, V] fp32, each row at its temperature (`temperatures` [N] fp32), by the kernel
    or row by row (`exact_logprobs`): the sampler's logprobs and the trainer's, computed alike."""
    logits_NV = logits_NV.float()
    if batch_invariant.is_available(logits_NV.device):
        return batch_invariant.log_softmax(logits_NV, temperatures)
    if not logits_NV.shape[0]:
        return logits_NV.clone()
    return torch.stack([exact_logprobs(logits_NV[i], temperatures[i]) for i in range(logits_NV.shape[0])])


class ExactDocumentAttention:
    """The trainer's attention backend in exact mode (row_lengths[b]: the document lengths of row b): each
    token by `attention_kernel.attend_each_token` on the kernel path, else each document of each packed row
    by `exact_causal_attention`; for latent attention blocks, each token's context in its row
    (`exact_latent.ExactLatentBackend`)."""

    def __init__(self, row_lengths: list[list[int]]):
        self.row_lengths = row_lengths
        self._kernel_inputs: tuple[DocumentCausalAttention, PackedDocuments] | None = None

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if attention_uses_kernels(q.device, q.shape[-1]):
            if self._kernel_inputs is None:  # once per forward: every layer attends over the same documents
                tile_tokens = attention_kernel.exact_tile_tokens(q.shape[2], k.shape[2])
                self._kernel_inputs = (DocumentCausalAttention(self.row_lengths, q.device, BACKWARD_SDPA),
                                       packed_documents(self.row_lengths, q.shape[1], tile_tokens, q.device))
            return _KernelDocumentAttention.apply(q, k, v, *self._kernel_inputs)
        rows = []
        for b, lengths in enumerate(self.row_lengths):
            rows.append(torch.cat([exact_causal_attention(q[b, s:s + n], k[b, s:s + n], v[b, s:s + n])
                                   for s, n in zip(document_starts(lengths), lengths)]))
        return torch.stack(rows)

    def latent_contexts(self, layer_idx: int, entries: torch.Tensor,
                        index_keys: torch.Tensor | None) -> list[TokenContext]:
        """Each token's entries and indexer keys from its document's start to it ([B, T, ...] -> slices)."""
        return [(entries[b, s:s + t + 1], index_keys[b, s:s + t + 1] if index_keys is not None else None)
                for b, lengths in enumerate(self.row_lengths)
                for s, n in zip(document_starts(lengths), lengths) for t in range(n)]


def document_starts(lengths: list[int]) -> list[int]:
    """Where each document of a packed row starts."""
    return [sum(lengths[:i]) for i in range(len(lengths))]


PACKED_PAGE = 16
"""Keys per page of the trainer's packed keys seen as a paged cache (the engine's default block size; a page
only addresses keys: the kernel's chunks and their order do not depend on it)."""

BACKWARD_SDPA = ["flash", "efficient", "math"]
"""The fused kernels the trainer's backward through exact attention recomputes with (gradients need not be
batch-invariant: only the forward values are compared with the engine's)."""


@dataclass
class PackedDocuments:
    """The documents of packed rows [B, seq_len] as the sequences of a paged cache over the flattened keys, for
    `attention_kernel.attend_each_token`: document d's page j starts at key token doc_start + j * page."""

    block_tables: torch.Tensor
    """[documents, pages of the longest]."""
    lengths: torch.Tensor
    """[documents] (a document's context: all of it)."""
    query_start: torch.Tensor
    """[documents + 1] offsets of the documents' tokens in the flattened rows."""
    tiles: torch.Tensor
    token_contexts: torch.Tensor
    """[B * seq_len] each token's position + 1."""
    longest: int


def packed_documents(row_lengths: list[list[int]], seq_len: int, tile_tokens: int, device: torch.device,
                     page: int = PACKED_PAGE) -> PackedDocuments:
    lengths, starts = [], []
    for b, row in enumerate(row_lengths):
        offset = b * seq_len
        for n in row:
            lengths.append(n)
            starts.append(offset)
            offset += n
    longest = max(lengths)
    tables = np.array(starts)[:, None] + np.arange(-(-longest // page))[None] * page
    contexts = np.concatenate([np.arange(1, n + 1) for n in lengths])
    to_device = functools.partial(torch.as_tensor, device=device)
    return PackedDocuments(block_tables=to_device(tables), lengths=to_device(np.array(lengths, dtype=np.int32)),
                           query_start=to_device(np.array(starts + [starts[-1] + lengths[-1]], dtype=np.int64)),
                           tiles=attention_kernel.exact_tiles(lengths, tile_tokens, device),
                           token_contexts=to_device(contexts.astype(np.int32)), longest=longest)


class _KernelDocumentAttention(torch.autograd.Function):
    """Forward: exact mode's kernel over the packed keys seen as overlapping pages; backward: the reference's."""

    @staticmethod
    def forward(ctx, q, k, v, reference, documents):
        ctx.save_for_backward(q, k, v)
        ctx.reference = reference
        B, T, H, D = q.shape
        num_kv = k.shape[2]
        page = PACKED_PAGE
        token = num_kv * D  # elements per key token
        # Page p is the `page` key tokens from token p on: pages overlap, so a page may start at any document.
        k_pages, v_pages = (torch.cat([t.reshape(B * T, num_kv, D), t.new_zeros(page, num_kv, D)])
                            .as_strided((B * T, page, num_kv, D), (token, token, D, 1)) for t in (k, v))
        out = attention_kernel.attend_each_token(q.reshape(B * T, H, D), k_pages, v_pages, documents.block_tables,
                                                 documents.lengths, documents.query_start, documents.tiles,
                                                 documents.token_contexts, documents.longest)
        return out.view(B, T, H, D)

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors
        with torch.enable_grad():
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
            grads = torch.autograd.grad(ctx.reference.attend(0, q, k, v), (q, k, v), grad)
        return (*grads, None, None)


def check_exact(hf_config: dict, source: str) -> None:
    """Refuse what exact mode cannot honour, saying why (the config's resolve step says it first, by key)."""
    from tandem.models.loading import is_native

    if not is_native(hf_config):
        raise ValueError(f"`run.exact` needs a model native to tandem; {source} says model_type "
                         f"{hf_config.get('model_type')!r}, which falls back to transformers, whose kernels are not batch-invariant")


def exact_token_logprobs(hidden_ND: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                         temperatures: torch.Tensor, chunk_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's head in exact mode: (logprob of each target, entropy) [N] fp32, as the engine computes the
    sampled token's logprob (`exact_logits`, `exact_log_softmax`). Differentiable, `chunk_size` rows at a time,
    each chunk recomputed in backward: a row's numbers do not depend on its chunk, and no [N, V] tensor is kept."""
    chunks = [checkpoint(_chunk_logprobs, hidden_ND[i:i + chunk_size], weight, bias, targets[i:i + chunk_size],
                         temperatures[i:i + chunk_size], use_reentrant=False)
              for i in range(0, hidden_ND.shape[0], chunk_size)]
    return torch.cat([lp for lp, _ in chunks]), torch.cat([entropy for _, entropy in chunks])


def _chunk_logprobs(hidden_ND: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                    temperatures: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logp = exact_log_softmax(exact_logits(hidden_ND, weight, bias), temperatures)
    entropy = -(logp.exp() * logp).sum(-1).detach()
    return logp.gather(-1, targets[:, None])[:, 0], entropy
