"""The math every native family shares: RMS norm, rotary embeddings, the dense SwiGLU feed-forward.

Each rule is written once, as a function of tensors: the modules of `tandem.models` call it, the
trainer compiles it (`tandem.trainer.block`) and the engine compiles it (`fused_norms`), so the
three compute the same function by construction, not by a test holding copies equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
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


@dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE scaling (arXiv 2309.00071) with transformers' conventions (`rope_type = "yarn"`): the
    fast-rotating dimensions keep their frequencies (extrapolation), the slow ones are divided by
    `factor` (interpolation), with a linear ramp between, and cos/sin are scaled by `attention_factor`."""

    factor: float
    original_max_position_embeddings: int
    """The context length the model was pretrained with."""
    attention_factor: float
    """Multiplies cos and sin (so q.k by its square): resolved from `mscale`/`mscale_all_dim` when not given."""
    beta_fast: float = 32.0
    """Rotations over the original context above which a dimension extrapolates."""
    beta_slow: float = 1.0
    """Rotations below which a dimension interpolates."""
    truncate: bool = True
    """Round the ramp's bounds to whole dimensions."""

    def inv_freq(self, rotary_dim: int, theta: float, device: torch.device) -> torch.Tensor:
        pos_freqs = theta ** (torch.arange(0, rotary_dim, 2, device=device, dtype=torch.float32) / rotary_dim)

        def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times in the original context
            return rotary_dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, rotary_dim - 1)
        if low == high:
            high += 0.001  # no division by zero
        # made on `device`: a host tensor copied in would break the engine's CUDA-graph capture
        ramp = ((torch.arange(rotary_dim // 2, device=device, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolate = 1 - ramp
        return (1.0 / (self.factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate


def rope_cos_sin(position_ids: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype,
                 yarn: YarnScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [B, T, rotary_dim] for the given positions (computed in fp32, no buffers to init).

    `rotary_dim` is the head dimension, or the part of it that rotates (`partial_rotary_factor`);
    `yarn`: YaRN scaling of the frequencies and of cos/sin, None for plain RoPE."""
    if yarn is None:
        inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, device=position_ids.device, dtype=torch.float32) / rotary_dim)
    else:
        inv_freq = yarn.inv_freq(rotary_dim, theta, position_ids.device)
    freqs = position_ids.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if yarn is not None:
        cos, sin = cos * yarn.attention_factor, sin * yarn.attention_factor
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, T, H, D] by cos/sin [B, T, R] (HF's rotate-half convention); with R < D
    (partial rotary) only the first R features of each head rotate, the rest pass through."""
    cos, sin = cos[:, :, None], sin[:, :, None]
    rotary_dim = cos.shape[-1]
    rot, rest = (x, None) if rotary_dim == x.shape[-1] else (x[..., :rotary_dim], x[..., rotary_dim:])
    x1, x2 = rot.chunk(2, dim=-1)
    rot = rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return rot if rest is None else torch.cat((rot, rest), dim=-1)


def projection_weight(linear: nn.Linear) -> torch.Tensor:
    """The matrix a projection multiplies by: its `weight`, or, for a projection with a LoRA adapter
    (`tandem.models.lora.LoraLinear`), the adapted weight."""
    adapted = getattr(linear, "adapted_weight", None)
    return linear.weight if adapted is None else adapted()


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
           linear: Callable[..., torch.Tensor] = F.linear) -> torch.Tensor:
    """The dense feed-forward: down(silu(gate(x)) * up(x)), weights in `nn.Linear` layout [out, in]; `linear`
    computes the projections (exact mode passes a batch-invariant kernel)."""
    return linear(F.silu(linear(x, w_gate, None)) * linear(x, w_up, None), w_down, None)


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
        return projection_weight(self.gate_proj), projection_weight(self.up_proj), projection_weight(self.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x, *self.tensor_args())
