"""Exact mode's attention of one query token against exactly its context (`tandem.models.exact`): the dense
blocks' token-by-token path and the latent blocks' (`tandem.models.exact_latent`) both attend through it, so
engine and trainer compute each token's attention by one function."""

from __future__ import annotations

import math

import torch


def exact_attention(q_HD: torch.Tensor, k_CKD: torch.Tensor, v_CKD: torch.Tensor, scale: float | None = None
                    ) -> torch.Tensor:
    """One query token q [H, D] against the context it attends to, k [C, Hkv, D], v [C, Hkv, Dv] (its position's
    tokens up to itself, or DSA's choice of them): [H, Dv]. `scale`: of the scores, 1 / sqrt(D) by default.

    Shapes and layouts depend only on the token's position, so its reduction orders and code paths do too."""
    group = q_HD.shape[0] // k_CKD.shape[1]
    k_HCD = k_CKD.repeat_interleave(group, dim=1).transpose(0, 1).contiguous()
    v_HCD = v_CKD.repeat_interleave(group, dim=1).transpose(0, 1).contiguous()
    scale = 1.0 / math.sqrt(q_HD.shape[-1]) if scale is None else scale
    scores = (k_HCD.float() * q_HD.float()[:, None]).sum(-1) * scale  # [H, C]
    p = scores.softmax(-1)
    return (p[:, :, None] * v_HCD.float()).sum(1).to(q_HD.dtype)
