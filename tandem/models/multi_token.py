"""The parts every multi-token prediction (MTP) layer shares, whatever block it wraps.

DeepSeek-V3's MTP layer (GLM-5 ships one; `tandem model add-draft-head` gives one to the decoder families) computes,
from the causal LM's final hidden state h_t and the embedding e of token t+1, the LM head's input for token t+2:

    x = eh_proj([enorm(e) ; hnorm(h_t)]) -> one block of the family's -> shared_head.norm

and takes its logits from the model's `lm_head` (the checkpoints store no head of its own). `MtpParts` holds the
parts around the block under the checkpoints' names (`enorm`, `hnorm`, `eh_proj`, `shared_head.norm`); a family's
layer is its block class with these parts: `glm_moe_dsa.MultiTokenPrediction` (latent attention, MoE),
`decoder.DraftHead` (grouped-query attention, dense SwiGLU).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from tandem.models.layers import RMSNorm


def mtp_layers(lm: nn.Module) -> nn.ModuleList:
    """The model's MTP layers (`model.mtp_layers`); an empty list for a model without them (a transformers fallback)."""
    layers = getattr(getattr(lm, "model", None), "mtp_layers", None)
    return layers if layers is not None else nn.ModuleList()


MTP_LAYER_NAME = re.compile(r"model\.mtp_layers\.(\d+)\.")
"""The in-memory names of MTP layer i's tensors."""


def without_left_out_layers(lm: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (in-memory names) without the tensors of the MTP layers its config names but `lm` was built without
    (`loading.build_native`'s `keep_mtp`: an engine that does not draft with them), which a policy update carries
    where the trainer has them (weights, block scales, LoRA adapters: `model.mtp_layers.{i}.*`). Any other name
    stays, so that a name the model lacks is still refused. A transformers model (the recompute path) has no
    `hf_config` of tandem's and left none out."""
    num_left_out = num_left_out_layers(lm)
    return {name: tensor for name, tensor in state.items()
            if not ((match := MTP_LAYER_NAME.match(name)) and int(match.group(1)) < num_left_out)}


def num_left_out_layers(lm: nn.Module) -> int:
    """How many of the MTP layers its config names `lm` was built without (`without_left_out_layers`)."""
    return (getattr(lm, "hf_config", {}).get("num_nextn_predict_layers") or 0) - len(mtp_layers(lm))


class MtpParts(nn.Module):
    """Mixed into a block class: `add_mtp_parts` in its constructor, then `mtp_input` before the block and
    `mtp_output` after it."""

    def add_mtp_parts(self, hidden_size: int, eps: float) -> None:
        self.enorm = RMSNorm(hidden_size, eps)
        self.hnorm = RMSNorm(hidden_size, eps)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(hidden_size, eps)

    def mtp_input(self, hidden: torch.Tensor, next_embeds: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, H] (the LM's output at t), next_embeds [B, T, H] (token t+1's embedding) -> the block's
        input [B, T, H]."""
        return self.eh_proj(torch.cat((self.enorm(next_embeds), self.hnorm(hidden)), dim=-1))

    def mtp_output(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output -> the LM head's input for token t+2."""
        return self.shared_head.norm(x)
