"""Expert parallelism: each MoE block's routed experts split over the `ep` axis, tokens sent to them.

Applied from outside to the single-device model (the model code never knows its mesh):

- the expert weights (`mlp.experts`, every parameter [E, ...]) become DTensors `Shard(0)` over
  `ep`: rank j of an EP group holds experts [j * E/ep, (j + 1) * E/ep);
- the experts module's forward is wrapped: its input is the rows of this rank's tokens sorted by
  expert and `num_tokens_per_expert` [E] (`tandem.models.moe`). The wrapper
    1. exchanges the counts (all-to-all of [E]), then sends each rank the rows of its experts
       (all-to-all of the rows, in expert order: rank-major, expert-minor on arrival);
    2. reorders the received rows expert-major and runs the module's own forward on the local
       experts' weights (grouped GEMM on Hopper in bf16, a loop elsewhere);
    3. undoes the reorder and sends each row back (the reverse all-to-all), so the module's
       output is its input's rows in their order, as without EP.
  Both all-to-alls are differentiable (backward is the reverse exchange). The split sizes must be
  known on the host: one device-to-host copy per MoE block and micro-batch.

The wrapper replaces the module's `forward` attribute (as activation checkpointing does), so
parameter names and FSDP's hooks around the module's call stay as they are. FSDP is applied
afterwards (`tandem.trainer.parallel.fsdp`), over the `efsdp` axis for the experts.
"""

from __future__ import annotations

import copy
import functools

import torch
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.func import functional_call

from tandem.models.hf_config import transformers_config
from tandem.models.moe import MoE


def moe_blocks(blocks: nn.ModuleList) -> list[MoE]:
    """The sparse feed-forwards of `blocks`, in layer order."""
    return [block.mlp for block in blocks if isinstance(getattr(block, "mlp", None), MoE)]


EXPERT_COUNT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")
"""Names of the routed expert count in config.json files (transformers 5, Qwen3-MoE before it, GLM-4.5)."""


def check_expert_parallel(ep: int, hf_config: dict, source: str) -> None:
    """`parallel.ep` > 1 needs a mixture of experts whose expert count it divides (every EP rank holds
    the same number of whole experts). Reads the config only: callable before any process group."""
    if ep == 1:
        return
    resolved = transformers_config(hf_config)  # aliases and defaults as transformers resolves them
    count = next((getattr(resolved, f) for f in EXPERT_COUNT_FIELDS if getattr(resolved, f, None)), None)
    if count is None:
        raise ValueError(f"`parallel.ep` = {ep} but {source} has no routed experts (none of {', '.join(EXPERT_COUNT_FIELDS)}); "
                         "set `parallel.ep` = 1")
    field = next((f for f in EXPERT_COUNT_FIELDS if f in hf_config), EXPERT_COUNT_FIELDS[0])
    if count % ep:
        raise ValueError(f"`parallel.ep` = {ep} does not divide the model's expert count (`{field}` = {count} "
                         f"in {source}); pick a divisor of {count}")


def apply_expert_parallel(blocks: nn.ModuleList, ep_mesh: DeviceMesh) -> None:
    """Shard the routed experts of every MoE block over `ep_mesh` and wrap their forward, in place.
    Call it on the meta-device model, before FSDP."""
    for moe in moe_blocks(blocks):
        experts = moe.experts
        local = copy.deepcopy(experts)  # a twin for the local math: outside the module tree, no hooks
        for name, param in list(experts.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)])
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        local.num_experts = experts.num_experts // ep_mesh.size()
        experts.forward = functools.partial(expert_parallel_forward, experts, local, ep_mesh)


def expert_parallel_forward(experts: nn.Module, local: nn.Module, ep_mesh: DeviceMesh, x: torch.Tensor,
                            num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """x [M, H] sorted by expert, counts [E] -> the experts' outputs [M, H] in x's row order."""
    group, ep = ep_mesh.get_group(), ep_mesh.size()
    num_local = num_tokens_per_expert.numel() // ep
    # received[s, l]: rows source rank s sends to this rank's local expert l.
    received = all_to_all_single(num_tokens_per_expert, None, None, group).view(ep, num_local)
    splits = torch.stack([num_tokens_per_expert.view(ep, num_local).sum(1), received.sum(1)]).tolist()  # the host sync
    send_splits, receive_splits = splits
    rows = all_to_all_single_autograd(x, receive_splits, send_splits, group)
    order = expert_major_order(received, sum(receive_splits))
    weights = {name: local_weight(p, ep) for name, p in experts.named_parameters(recurse=False)}
    out = functional_call(local, weights, (rows[order], received.sum(0)))
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    return all_to_all_single_autograd(out[back], send_splits, receive_splits, group)


def local_weight(param: DTensor, ep: int) -> torch.Tensor:
    """This rank's experts of a gathered expert weight (a DTensor `Shard(0)` over `ep`), their gradient scaled by 1 / ep.

    Each expert's gradient sums the tokens of its whole EP group (the backward of the all-to-all)
    and FSDP then averages it over the `efsdp` ranks (world / ep of them), while the loss is
    normalized for an average over all ranks: 1 / ep makes it the gradient every dense weight gets.
    (FSDP's own `set_gradient_divide_factor` would say the same, but gloo lacks its PREMUL_SUM.)"""
    local = param.to_local()  # a new autograd node per call: the hook lives as long as this forward's graph
    if local.requires_grad:
        local.register_hook(lambda grad: grad / ep)
    return local


def expert_major_order(received: torch.Tensor, num_rows: int) -> torch.Tensor:
    """received [ep, L] counts of rows laid out rank-major -> the row order that groups them by local expert
    (stable: within an expert, by source rank, then as sent)."""
    ep, num_local = received.shape
    segment = torch.repeat_interleave(torch.arange(ep * num_local, device=received.device), received.reshape(-1),
                                      output_size=num_rows)
    key = (segment % num_local) * ep + segment // num_local
    return torch.argsort(key, stable=True)
