"""Activation checkpointing of transformer blocks: recompute a block's activations in backward.

The block's `forward` is replaced by a checkpointed call of itself instead of wrapping the block
in another module, so parameter names (the HF names the checkpoints and published weights use)
do not change. Apply it before FSDP, as torchtitan does: FSDP's hooks then sit outside the
checkpointed region and re-gather the block's parameters before the recompute.

`selective` is not applied here: the trainer's block forward (`tandem.trainer.block`) does it
inside the block, around attention.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

from tandem.config.trainer import ActivationCheckpointConfig


def apply_activation_checkpoint(blocks: nn.ModuleList, config: ActivationCheckpointConfig) -> list[int]:
    """Checkpoint the blocks `config` selects entirely, in place; returns their indices."""
    if config.mode in ("off", "selective"):
        return []
    step = 1 if config.mode == "full" else config.k
    chosen = list(range(0, len(blocks), step))
    for i in chosen:
        block = blocks[i]
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return chosen
