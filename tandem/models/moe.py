"""A mixture-of-experts feed-forward on one device, in four parts (torchtitan style):

    x [N, H] -> route     top-k expert ids and weights per token (`TopKRouter`, weight `gate.weight` [E, H])
             -> permute   the N*k token copies sorted by expert, and `num_tokens_per_expert` [E]
             -> experts   `GroupedExperts`: each expert's SwiGLU over its contiguous rows
             -> unpermute each copy times its routing weight, the k copies of a token summed
             (+ shared experts, a dense SwiGLU every token goes through: GLM-4.5)

Expert parallelism is applied from outside by hooks on the `experts` module, whose whole input is
(x_sorted [N*k, H], num_tokens_per_expert [E]) and output the rows in the same order: a hook can
all-to-all the rows to the ranks owning their experts before, and back after.

Parameter names are transformers 5's in-memory names (`mlp.gate.weight`, `mlp.experts.gate_up_proj`
[E, 2*I, H] with the gate rows first, `mlp.experts.down_proj` [E, H, I]); checkpoints on disk
store one tensor per expert, converted in `tandem.models.expert_layout`. The score correction bias
(sigmoid routers) is a parameter without gradient, so sharding, loading, publishing and
checkpointing treat it as any other weight; an optimizer skips it (aux-free balancing updates it).

Shapes depend on routing, so this module runs outside compiled regions (`tensor_function` None).
On CUDA in bf16 the experts run as grouped GEMMs with no host sync; elsewhere one matmul per expert.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from tandem.models.layers import MLP


@dataclass
class MoEArgs:
    num_experts: int
    """Routed experts per layer (E)."""
    top_k: int
    """Experts each token goes to (k)."""
    hidden_size: int
    intermediate_size: int
    """Hidden features of each routed expert's SwiGLU (I; `moe_intermediate_size` in HF configs)."""
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    """softmax over all experts (Qwen3-MoE) or an independent sigmoid per expert (GLM-4.5, MiniMax-M2)."""
    norm_topk_prob: bool = False
    """Renormalize the k chosen scores to sum to 1."""
    n_group: int = 1
    """Experts are split in this many groups; tokens choose among the `topk_group` best groups only."""
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    """Multiplies the routing weights (after renormalization)."""
    score_bias: Literal["none", "router", "block"] = "none"
    """Where `e_score_correction_bias` [E] lives: none, on the router (GLM-4.5: `mlp.gate.`), on the block
    (MiniMax-M2: `mlp.`). It is added to the scores to choose experts, never to the weights."""
    router_fp32: bool = False
    """Compute the router logits in fp32 whatever the model's dtype (GLM-4.5)."""
    num_shared_experts: int = 0
    """Shared experts, as one dense SwiGLU of `num_shared_experts * intermediate_size` features."""


def route(x: torch.Tensor, weight: torch.Tensor, score_bias: torch.Tensor | None, args: MoEArgs,
          replayed_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, H] -> routing weights [N, k] (fp32) and expert ids [N, k] (int64).

    `replayed_ids` [N, k] (router replay): use these experts where a row's ids are >= 0 instead of the
    top-k; the weights are still the router's scores of the experts used, so they stay differentiable."""
    logits = F.linear(x.float(), weight.float()) if args.router_fp32 else F.linear(x, weight)
    scores = logits.float().softmax(-1) if args.score_func == "softmax" else logits.float().sigmoid()
    choice = scores if score_bias is None else scores + score_bias.float()
    if args.n_group > 1:
        choice = limit_to_top_groups(choice, args.n_group, args.topk_group)
    expert_ids = torch.topk(choice, args.top_k, dim=-1).indices
    if replayed_ids is not None:
        expert_ids = torch.where(replayed_ids[:, :1] >= 0, replayed_ids.long(), expert_ids)
    weights = scores.gather(1, expert_ids)
    if args.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights * args.routed_scaling_factor, expert_ids


@contextlib.contextmanager
def replayed_routing(model: nn.Module, expert_ids: torch.Tensor):
    """Within this block, the model's MoE layers use `expert_ids` [N, num_moe_layers, k] (N = the
    forward's tokens, flattened; rows of -1 route as usual) instead of choosing their experts. The MoE layers are
    those of the model's `layers` where it has them: not a multi-token prediction layer, which the forward never runs
    and the engine reports no routing for."""
    routers = [m for m in getattr(model, "layers", model).modules() if isinstance(m, TopKRouter)]
    if expert_ids.shape[1] != len(routers):
        raise ValueError(f"replayed routing has {expert_ids.shape[1]} MoE layers, the model {len(routers)}")
    for i, router in enumerate(routers):
        router.replayed_ids = expert_ids[:, i]
    try:
        yield
    finally:
        for router in routers:
            router.replayed_ids = None


def limit_to_top_groups(choice: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """Mask (-inf) the experts outside each token's `topk_group` best groups; a group's score is
    the sum of its two best experts' scores (DeepSeek-V3's rule, which GLM-4.5 keeps)."""
    N, E = choice.shape
    grouped = choice.view(N, n_group, E // n_group)
    group_scores = grouped.topk(2, dim=-1).values.sum(-1)
    top_groups = group_scores.topk(topk_group, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, top_groups, True)
    return grouped.masked_fill(~keep[:, :, None], float("-inf")).view(N, E)


class TopKRouter(nn.Module):
    def __init__(self, args: MoEArgs):
        super().__init__()
        self.args = args
        self.weight = nn.Parameter(torch.empty(args.num_experts, args.hidden_size))
        self.replayed_ids: torch.Tensor | None = None
        if args.score_bias == "router":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(args.num_experts), requires_grad=False)

    def forward(self, x: torch.Tensor, score_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (weights [N, k] fp32, expert ids [N, k]); `score_bias`: a bias owned by the block.

        `replayed_ids` [N, k] (None: route by the scores), set from outside for one forward by router
        replay (`replayed_routing`); see `route`."""
        if self.args.score_bias == "router":
            score_bias = self.e_score_correction_bias
        return route(x, self.weight, score_bias, self.args, self.replayed_ids)


def fp32_routers(model: nn.Module) -> list[TopKRouter]:
    """The routers that compute in fp32 (`router_fp32`): transformers and vLLM keep GLM-4.5's router weight and
    score bias in fp32, and a bf16 router weight would choose other experts for tokens near a tie. Every cast of a
    model's weights to a compute dtype leaves their parameters fp32: a load (`keep_routers_fp32`), the trainer's
    mixed precision and its frozen LoRA base."""
    return [module for module in model.modules() if isinstance(module, TopKRouter) and module.args.router_fp32]


def fp32_router_parameters(model: nn.Module) -> set[int]:
    """The ids of `fp32_routers`' parameters: what a cast to a compute dtype passes over."""
    return {id(param) for router in fp32_routers(model) for param in router.parameters()}


def keep_routers_fp32(model: nn.Module) -> None:
    """Cast `fp32_routers` back to fp32 after a model-wide cast, in place."""
    for module in fp32_routers(model):
        module.float()


def permute(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """expert_ids [N, k] -> (order [N*k]: token copies sorted by expert, stable; num_tokens_per_expert [E]).

    Copy j of the sorted rows is token `order[j] // k`. Shapes are fixed by N and k (no host sync)."""
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    return order, counts


def unpermute(rows: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Expert outputs in sorted order [N*k, H] -> sum over each token's k copies of weight * output [N, H].

    The rows go back to token order by an index write (each position once: deterministic, unlike
    atomic adds), then the k copies of each token are summed."""
    N, k = weights.shape
    weighted = rows * weights.reshape(-1)[order, None].to(rows.dtype)
    unsorted = torch.empty_like(weighted)
    unsorted[order] = weighted
    return unsorted.view(N, k, -1).sum(1)


def has_grouped_mm(x: torch.Tensor) -> bool:
    """`torch._grouped_mm` serves x: bf16 on a CUDA device of compute capability 9.0 or newer (Hopper)."""
    return (hasattr(torch, "_grouped_mm") and x.is_cuda and x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device) >= (9, 0))


class GroupedExperts(nn.Module):
    """E SwiGLU experts as stacked weights: `gate_up_proj` [E, 2*I, H] (gate rows, then up rows), `down_proj` [E, H, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The stacked matrices the experts multiply by, (gate_up [E, 2*I, H], down [E, H, I]): the parameters here,
        the adapted weights with LoRA adapters on the experts (`tandem.models.lora.LoraExperts`)."""
        return self.gate_up_proj, self.down_proj

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x [M, H], rows grouped by expert (`num_tokens_per_expert[e]` rows of expert e, in order) -> [M, H]."""
        if has_grouped_mm(x):
            return self._grouped(x, num_tokens_per_expert)
        return self._looped(x, num_tokens_per_expert)

    def _grouped(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        gate_up_proj, down_proj = self.expert_weights()
        offsets = torch.cumsum(num_tokens_per_expert, 0, dtype=torch.int32)
        gate, up = torch._grouped_mm(x, gate_up_proj.transpose(-2, -1), offs=offsets).chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, down_proj.transpose(-2, -1), offs=offsets)

    def _looped(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        gate_up_proj, down_proj = self.expert_weights()
        outputs = []
        for e, rows in enumerate(torch.split(x, num_tokens_per_expert.tolist())):
            gate, up = F.linear(rows, gate_up_proj[e]).chunk(2, dim=-1)
            outputs.append(F.linear(F.silu(gate) * up, down_proj[e]))
        return torch.cat(outputs)


class MoE(nn.Module):
    """A block's sparse feed-forward (see `FeedForward` in `tandem.models.decoder`): x [B, T, H] -> [B, T, H]."""

    tensor_function = None
    """Routing makes shapes data-dependent: never compiled into a block's half."""

    def __init__(self, args: MoEArgs):
        super().__init__()
        self.args = args
        self.gate = TopKRouter(args)
        self.experts = GroupedExperts(args.num_experts, args.hidden_size, args.intermediate_size)
        self.shared_experts = (MLP(args.hidden_size, args.num_shared_experts * args.intermediate_size)
                               if args.num_shared_experts else None)
        if args.score_bias == "block":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(args.num_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        block_bias = self.e_score_correction_bias if self.args.score_bias == "block" else None
        weights, expert_ids = self.gate(flat, block_bias)
        order, num_tokens_per_expert = permute(expert_ids, self.args.num_experts)
        rows = self.experts(flat[order // self.args.top_k], num_tokens_per_expert)
        out = unpermute(rows, order, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view(x.shape)
