"""FSDP2 over a trainer model: one `fully_shard` per transformer block, then the root.

With expert parallelism the routed experts of each MoE block are a group of their own, sharded
over the `efsdp` axis (the data-parallel ranks left once `ep` is taken), before their block.

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

from tandem.models.moe import fp32_routers
from tandem.trainer.parallel.dims import EFSDP
from tandem.trainer.parallel.expert_parallel import moe_blocks


def apply_fsdp(root: nn.Module, blocks: nn.ModuleList, mesh: DeviceMesh, param_dtype: torch.dtype,
               reduce_dtype: torch.dtype, reshard_after_forward: bool, expert_mesh: DeviceMesh | None = None) -> None:
    """Shard `blocks` one by one, then `root` (which must contain them), in place; `expert_mesh`:
    the (efsdp, ep) mesh when the routed experts are expert-parallel."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    if expert_mesh is not None:
        for moe in moe_blocks(blocks):
            # FSDP divides these gradients by the efsdp size, not the world size: the expert-parallel
            # forward scales them by 1 / ep for that (`expert_parallel_forward`).
            fully_shard(moe.experts, mesh=expert_mesh[EFSDP], mp_policy=policy, reshard_after_forward=reshard_after_forward)
    # Routers that compute in fp32 (`moe.fp32_routers`) are units of their own that gather fp32 (their input is cast
    # by the router itself), kept gathered from forward to backward: a few KiB, which the router's statistics read
    # after its forward (`tandem.trainer.router`).
    fp32_policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    for router in fp32_routers(blocks):
        fully_shard(router, mesh=mesh, mp_policy=fp32_policy, reshard_after_forward=False)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    # The root's floating inputs stay as they are: casting them to `param_dtype` would round the
    # temperatures (0.7 -> 0.69921875 in bf16) and so every logprob of a tempered sample.
    root_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    # The root's parameters are needed again right at the start of backward (the LM head):
    # keeping them gathered after forward saves one all-gather per micro-batch.
    fully_shard(root, mesh=mesh, mp_policy=root_policy, reshard_after_forward=False)
