"""Attention backends: how a layer's q, k, v become its output.

The model code calls `backend.attend(layer_idx, q, k, v)` and knows nothing else. Packed rows
(documents packed in a row, positions restart at each one) never attend across documents:
`PackedCausalAttention` finds the documents from the position ids (the model's default),
`DocumentCausalAttention` is told them by the trainer and uses variable-length kernels; the
inference engine passes its own backend that reads and writes a paged KV cache.
Shapes: q [B, T, Hq, D], k and v [B, T, Hkv, D], output [B, T, Hq, D].
"""

from __future__ import annotations

import functools
import inspect
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


class AttentionBackend(Protocol):
    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class CachedAttention(Protocol):
    """A backend whose keys and values live in a cache the block may write itself (the engine's paged cache), so
    that a kernel computing the keys stores them in their slots directly: where `reads_only_the_cache`, the block
    writes its step's keys and values into `cache_slots` and calls `attend_cached` instead of `attend`."""

    def reads_only_the_cache(self, head_dim: int, device: torch.device) -> bool: ...

    def cache_slots(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                    torch.Tensor | None]:
        """(keys [blocks, S, Hkv, D], values, the slot of each token of the step [N], the keys' and the values' scales
        [blocks, S, Hkv] of an FP8 cache, else None and None): the trailing arguments of
        `tandem.kernels.pointwise.qk_norm_rope_write`."""
        ...

    def attend_cached(self, layer_idx: int, q_NHD: torch.Tensor) -> torch.Tensor: ...


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Per-token document index within each row: a new document starts where position is 0."""
    return torch.cumsum((position_ids == 0).to(torch.int32), dim=-1)


def document_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, T, T] bool: query t may see key s (same document, s <= t)."""
    doc = document_ids(position_ids)
    T = position_ids.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=position_ids.device).tril()
    return (doc[:, :, None] == doc[:, None, :]) & causal


class PackedCausalAttention:
    """Causal attention within each packed document, through `scaled_dot_product_attention`.

    Rows holding a single document take the `is_causal` path (no mask tensor); packed rows use a
    block-diagonal causal mask built once per forward and shared by all layers.
    """

    def __init__(self, position_ids: torch.Tensor):
        starts = (position_ids[:, 1:] == 0).any()
        self.mask: torch.Tensor | None = None
        if bool(starts):
            self.mask = document_causal_mask(position_ids)[:, None]  # [B, 1, T, T]

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, T, D]
        gqa = q.shape[1] != k.shape[1]
        if self.mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, enable_gqa=gqa)
        return out.transpose(1, 2)


def document_lengths(position_ids: list[int]) -> list[int]:
    """Lengths of the documents packed in one row: a new document starts where the position is 0."""
    starts = [t for t, p in enumerate(position_ids) if p == 0]
    if not starts or starts[0] != 0:
        raise ValueError("a packed row must start with position 0 (the first token of a document)")
    return [end - start for start, end in zip(starts, starts[1:] + [len(position_ids)])]


VARLEN_DTYPES = (torch.bfloat16, torch.float16)
"""The dtypes of variable-length FlashAttention (`varlen_attn`)."""

SDPA_BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
"""Names of the fused SDPA kernels `DocumentCausalAttention` may be told to prefer."""


class DocumentCausalAttention:
    """Causal attention inside each document of packed rows, for training; no mask tensor.

    The document lengths of every row are known on the host (the trainer reads them from the
    batch), so no step needs a device sync or a [T, T] mask:
    - a row holding one document takes SDPA's `is_causal` path; on CUDA with the fused kernels of
      `sdpa_backends` in that order of preference (cuDNN first: the fastest on Hopper);
    - packed rows on CUDA in bf16 or fp16 go through `torch.nn.attention.varlen.varlen_attn`
      (FlashAttention over the concatenated documents, cumulative lengths in `cu_seqlens`), which
      handles GQA natively;
    - other packed rows (CPU, fp32) run SDPA `is_causal` on each document's slice.
    """

    def __init__(self, row_lengths: list[list[int]], device: torch.device, sdpa_backends: list[str]):
        """`row_lengths[b]`: the document lengths of row b (summing to T); `sdpa_backends`: names of
        `SDPA_BACKENDS`, most preferred first."""
        unknown = [b for b in sdpa_backends if b not in SDPA_BACKENDS]
        if unknown:
            raise ValueError(f"unknown SDPA backends {unknown}; choose from {', '.join(SDPA_BACKENDS)}")
        self.row_lengths = row_lengths
        self.backends = [SDPA_BACKENDS[b] for b in sdpa_backends]
        self.packed = any(len(lengths) > 1 for lengths in row_lengths)
        self.cu_seqlens: torch.Tensor | None = None
        if self.packed and device.type == "cuda" and (varlen := _varlen_attn()) is not None:
            self.varlen = varlen
            flat = [n for lengths in row_lengths for n in lengths]
            offsets = [0]
            for n in flat:
                offsets.append(offsets[-1] + n)
            self.cu_seqlens = torch.tensor(offsets, dtype=torch.int32).to(device, non_blocking=True)
            self.max_len = max(flat)

    def traceable(self, dtype: torch.dtype) -> bool:
        """Whether attention in `dtype` runs the same ops whatever the document lengths (one document per row, or
        variable-length kernels), so that one compiled graph serves every batch; not where it loops over documents."""
        return not self.packed or (self.cu_seqlens is not None and dtype in VARLEN_DTYPES)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.cu_seqlens is not None and q.dtype in VARLEN_DTYPES:
            B, T, H, D = q.shape
            out = self.varlen(q.reshape(B * T, H, D), k.reshape(B * T, *k.shape[2:]), v.reshape(B * T, *v.shape[2:]),
                               self.cu_seqlens, self.max_len)
            return out.view(B, T, H, D)
        if not self.packed:
            return self._causal(q, k, v)
        rows = []
        for b, lengths in enumerate(self.row_lengths):
            docs, start = [], 0
            for n in lengths:
                docs.append(self._causal(q[b:b + 1, start:start + n], k[b:b + 1, start:start + n], v[b:b + 1, start:start + n]))
                start += n
            rows.append(torch.cat(docs, dim=1))
        return torch.cat(rows, dim=0)

    def _causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, T, D]
        gqa = q.shape[1] != k.shape[1]
        if q.is_cuda:
            with sdpa_kernel(self.backends, set_priority=True):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return out.transpose(1, 2)


@functools.cache
def _varlen_attn():
    """`varlen_attn(q, k, v, cu_seqlens, max_len)`, causal, GQA allowed; None where torch lacks it.

    Imported at first use, on CUDA: its module imports torch's compiler (dynamo), a cost at the start of every
    process that builds a model, which CPU runs never use.

    Its keyword arguments changed across torch releases (`is_causal` in 2.9-2.10, `window_size`
    later; `enable_gqa` once it checks head counts): the signature says which to pass.
    """
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    kwargs = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True

    def attend(q, k, v, cu_seqlens, max_len):
        return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, **kwargs)

    return attend

