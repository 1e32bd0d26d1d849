"""FSDP2 over a trainer model: one `fully_shard` per transformer block, then the root.

The root group holds what is outside the blocks (embeddings, final norm, LM head), so tied
embeddings (`lm_head.weight is embed_tokens.weight`) are one parameter of one group and stay tied.
Master weights stay fp32 (the optimizer steps on fp32 shards); `param_dtype` is the dtype blocks
compute in after the all-gather, `reduce_dtype` the dtype of the gradient reduce-scatter.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def apply_fsdp(root: nn.Module, blocks: nn.ModuleList, mesh: DeviceMesh, param_dtype: torch.dtype,
               reduce_dtype: torch.dtype, reshard_after_forward: bool) -> None:
    """Shard `blocks` one by one, then `root` (which must contain them), in place."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    # The root's floating inputs stay as they are: casting them to `param_dtype` would round the
    # temperatures (0.7 -> 0.69921875 in bf16) and so every logprob of a tempered sample.
    root_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    # The root's parameters are needed again right at the start of backward (the LM head):
    # keeping them gathered after forward saves one all-gather per micro-batch.
    fully_shard(root, mesh=mesh, mp_policy=root_policy, reshard_after_forward=False)
