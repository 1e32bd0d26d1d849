"""The slow path: any transformers causal LM behind tandem's model interface.

Packed rows work because transformers builds a block-diagonal causal mask from position ids
that restart at 0 when no attention mask is given (and `use_cache=False`). Custom attention
backends (the engine's paged KV cache) are not supported here: the engine recomputes instead.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tandem.models.hub import read_hf_config


class HFCausalLM(nn.Module):
    def __init__(self, hf_model: nn.Module, hf_config: dict):
        super().__init__()
        self.hf_model = hf_model
        self.hf_config = hf_config

    @classmethod
    def from_pretrained(cls, folder: Path, device, dtype: torch.dtype, trust_remote_code: bool) -> "HFCausalLM":
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, trust_remote_code=trust_remote_code, attn_implementation="sdpa")
        return cls(hf_model.to(device), read_hf_config(folder)).eval()

    @property
    def lm_head(self) -> nn.Module:
        return self.hf_model.get_output_embeddings()

    @property
    def layers(self) -> nn.ModuleList:
        return self.hf_model.base_model.layers

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention=None) -> torch.Tensor:
        if attention is not None:
            raise NotImplementedError("custom attention backends need a native tandem model")
        out = self.hf_model.base_model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        return out.last_hidden_state
