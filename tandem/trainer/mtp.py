"""Training the multi-token prediction (MTP) layer with the policy (`mtp.train`).

GLM-5 and DeepSeek-V3 checkpoints carry an MTP layer that predicts token t+2 from the trunk's hidden state at t and
the embedding of token t+1 (`tandem.models.glm_moe_dsa.MultiTokenPrediction`), and `tandem model add-draft-head`
gives the decoder families one (`tandem.models.decoder.DraftHead`); an engine drafts with it. As RL moves
the policy, a frozen layer keeps predicting an older policy and fewer of its drafts are accepted. With `mtp.train` the
layer learns at every step to predict the tokens of the step's rows: a cross-entropy loss on token t+2 wherever it is
a loss token of the same document as t (in RL the sampled completions, so the layer learns what the policy samples;
SFT-style, without advantages).

The trunk's hidden states and the embeddings enter that loss detached, and the LM head, which maps the layer's output
to logits as it does the trunk's, enters with its weight detached: the MTP loss reaches no parameter of the policy.
RL's objective must not change because a draft is trained beside it: the policy's loss, gradients, clipping (the
layer's gradients are clipped by their own norm, `mtp/grad_norm`) and updates are those of a run with the layer
frozen, bit for bit. The MTP loss's gradient is scaled as the objective's (per loss token of the step, over all
ranks); with its own clipping and AdamW's normalized updates it needs no weight against the policy's loss. The
layer's parameters otherwise train as a block's do: fp32 masters, the run's optimizer and schedule, a group of its
own under FSDP. As in the trunk, a latent layer's DSA indexer and its router's score correction bias stay frozen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import register_fsdp_forward_method

from tandem.models.attention import AttentionBackend
from tandem.models.dsa import Indexer
from tandem.models.moe import MoE
from tandem.models.multi_token import mtp_layers
from tandem.trainer.logprobs import token_logprobs
from tandem.trainer.router import score_bias_of


@dataclass
class MtpLoss:
    """One micro-batch's MTP loss."""

    loss_sum: torch.Tensor
    """Sum of -log p(token t+2) over the counted positions (carries the layer's gradient)."""
    num_tokens: torch.Tensor
    """Counted positions (fp32, 0-d)."""

    def metric_sums(self) -> dict[str, torch.Tensor]:
        return {"mtp/loss_sum": self.loss_sum.detach(), "mtp/tokens": self.num_tokens}


def check_mtp_trainable(lm: nn.Module, ep_size: int, source: str) -> None:
    """`mtp.train` needs one MTP layer (in `source`, the model's config.json: GLM-5 and DeepSeek-V3 carry one,
    `tandem model add-draft-head` adds one; a second would continue from the first's output, DeepSeek-V3's
    sequential MTP, which is not built) and the layer's experts whole on each rank."""
    count = len(mtp_layers(lm))
    if count != 1:
        raise ValueError(f"`mtp.train` = true but {source} has {count} multi-token prediction layers "
                         "(`num_nextn_predict_layers`; one is trained, and the family must keep them: "
                         "`tandem model add-draft-head` gives Qwen3, Qwen3-MoE and MiniMax-M2 models one); "
                         "set `mtp.train` = false")
    if ep_size > 1:
        raise ValueError(f"`mtp.train` with `parallel.ep` = {ep_size}: the MTP layer's experts are not split over "
                         "the expert-parallel ranks; set `parallel.ep` = 1 or `mtp.train` = false")


def unfreeze_mtp_layers(lm: nn.Module) -> None:
    """Let the MTP layer's parameters train, but for those the trunk keeps frozen too (the DSA indexer, the score
    correction bias)."""
    layers = mtp_layers(lm)
    layers.requires_grad_(True)
    for module in layers.modules():
        if isinstance(module, Indexer):
            module.requires_grad_(False)
        elif isinstance(module, MoE) and (bias := score_bias_of(module)) is not None:
            bias.requires_grad_(False)


def register_predict(lm: nn.Module) -> None:
    """After `fully_shard` of each MTP layer (sharded as a block is): gather its parameters around `predict`, which
    computes outside the module's `forward`."""
    for layer in mtp_layers(lm):
        register_fsdp_forward_method(layer, "predict")


def counted_positions(position_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: positions t whose token t+2 is a loss token of the same document (positions restart at each
    document, so t+2 is in t's document exactly when its position is t's plus 2)."""
    ahead = torch.zeros_like(loss_mask)
    ahead[:, :-2] = loss_mask[:, 2:] & (position_ids[:, 2:] == position_ids[:, :-2] + 2)
    return ahead


def mtp_loss(lm: nn.Module, hidden: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
             counted: torch.Tensor, positions: torch.Tensor, attention: AttentionBackend, chunk_size: int) -> MtpLoss:
    """The MTP loss of a row: `hidden` [B, T, H] the trunk's output, `counted` [B, T] from `counted_positions`,
    `positions` the flat indices of its set elements (at least one: a position not counted is computed and weighted
    0, so that every rank's layer takes part in backward, as FSDP needs). Token t+1 of a row's last position is
    any token: that position is never counted, and attention keeps it from the earlier ones."""
    head = lm.lm_head
    bias = head.bias.detach() if head.bias is not None else None
    draft = lm.predict_after_next(hidden, input_ids.roll(-1, 1), position_ids, attention, detach_inputs=True)
    targets = input_ids.roll(-2, 1).flatten()[positions]
    picked = draft.reshape(-1, draft.shape[-1]).index_select(0, positions)
    logprobs, _ = token_logprobs(picked, head.weight.detach(), bias, targets, torch.ones_like(targets, dtype=torch.float32),
                                 chunk_size)
    keep = counted.flatten()[positions].float()
    return MtpLoss(-(logprobs * keep).sum(), keep.sum())
