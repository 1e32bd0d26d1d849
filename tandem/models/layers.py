"""The math every native family shares: RMS norm, rotary embeddings, the dense SwiGLU feed-forward.

Each rule is written once, as a function of tensors: the modules of `tandem.models` call it, the
trainer compiles it (`tandem.trainer.block`) and the engine compiles it (`fused_norms`), so the
three compute the same function by construction, not by a test holding copies equal.
"""

from __future__ import annotations

from typing import Callable, ClassVar

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm over the last dimension in fp32, cast back, then the weight (as Hugging Face's Qwen3 does)."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_cos_sin(position_ids: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [B, T, rotary_dim] for the given positions (computed in fp32, no buffers to init).

    `rotary_dim` is the head dimension, or the part of it that rotates (`partial_rotary_factor`)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, device=position_ids.device, dtype=torch.float32) / rotary_dim)
    freqs = position_ids.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, T, H, D] by cos/sin [B, T, R] (HF's rotate-half convention); with R < D
    (partial rotary) only the first R features of each head rotate, the rest pass through."""
    cos, sin = cos[:, :, None], sin[:, :, None]
    rotary_dim = cos.shape[-1]
    rot, rest = (x, None) if rotary_dim == x.shape[-1] else (x[..., :rotary_dim], x[..., rotary_dim:])
    x1, x2 = rot.chunk(2, dim=-1)
    rot = rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return rot if rest is None else torch.cat((rot, rest), dim=-1)


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """The dense feed-forward: down(silu(gate(x)) * up(x)), weights in `nn.Linear` layout [out, in]."""
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


class MLP(nn.Module):
    """Dense SwiGLU feed-forward; a block's `mlp` (see `FeedForward` in `tandem.models.decoder`)."""

    tensor_function: ClassVar[Callable[..., torch.Tensor] | None] = staticmethod(swiglu)
    """The forward as a function of (x, *tensor_args()) with static shapes: callers may compile it."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def tensor_args(self) -> tuple[torch.Tensor, ...]:
        return self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x, *self.tensor_args())
