"""Qwen3 (dense) in plain PyTorch, with Hugging Face state-dict names.

Shared by the trainer and the inference engine so both compute the same function. Single-device
code only: parallelism (FSDP, activation checkpointing) is applied from outside, per block in
`model.layers`. `forward` returns the final hidden states; the caller applies `lm_head` where it
needs logits (the engine on last tokens, the trainer in chunks), so full logits never exist unasked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.models.attention import AttentionBackend, PackedCausalAttention


@dataclass
class Qwen3Args:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 40960

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "Qwen3Args":
        """Read a Qwen3 `config.json` (transformers 4.x `rope_theta` or 5.x `rope_parameters`)."""
        rope = config.get("rope_parameters") or {}
        theta = rope.get("rope_theta", config.get("rope_theta", 1_000_000.0))
        if rope.get("rope_type", "default") != "default" or config.get("rope_scaling"):
            raise ValueError("tandem's Qwen3 supports only default RoPE; use the transformers fallback")
        heads = config["num_attention_heads"]
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            attention_bias=config.get("attention_bias", False),
            max_position_embeddings=config.get("max_position_embeddings", 40960),
        )


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back, as Hugging Face's Qwen3 does."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [B, T, D] for the given positions (computed in fp32, no buffers to init)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim)
    freqs = position_ids.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, T, H, D] by cos/sin [B, T, D] (the rotate-half convention of HF)."""
    cos, sin = cos[:, :, None], sin[:, :, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, args: Qwen3Args, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        bias = args.attention_bias
        self.q_proj = nn.Linear(args.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, args.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = backend.attend(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, args: Qwen3Args):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: Qwen3Args, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(args, layer_idx)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(nn.Module):
    def __init__(self, args: Qwen3Args):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Qwen3ForCausalLM(nn.Module):
    """Qwen3 with an LM head; `forward` gives final hidden states [B, T, hidden]."""

    def __init__(self, args: Qwen3Args):
        super().__init__()
        self.args = args
        self.model = Qwen3Model(args)
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
        cos, sin = rope_cos_sin(position_ids, self.args.head_dim, self.args.rope_theta, h.dtype)
        for layer in self.model.layers:
            h = layer(h, cos, sin, backend)
        return self.model.norm(h)

    def init_weights(self, generator: torch.Generator | None = None, std: float = 0.02) -> None:
        """Random init: normal(0, std) matrices, unit norms (deterministic given `generator`)."""
        for name, p in sorted(self.named_parameters()):
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float32).to(p.dtype) * std)
