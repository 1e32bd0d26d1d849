"""Router statistics and load balancing of a model's MoE blocks, applied from outside by module hooks.

Per step, over every rank (`RouterMonitor`):
- expert load: tokens routed to each expert of each MoE block (counted in the k copies of each
  token, from the router's expert ids, replayed ones included), and max / mean of it;
- router entropy: per token, the entropy of the router's distribution over experts (softmax
  scores; sigmoid scores normalized to sum 1), averaged over tokens.
The counts stay on the device: one all-reduce and one host copy per step, none per layer.
They are gathered in training forwards only (`collecting()`): a recompute of an activation-
checkpointed block in backward would count its tokens twice. Padding that context parallelism adds
to a row (`collecting(real_tokens)`) is not counted, so the figures do not depend on the cp size.

Load balancing (both off by default: RL keeps the routing of the policy that sampled):
- `router.aux_loss_coef` = alpha: the balance loss of Switch / DeepSeek-V3 over the N tokens of a
  micro-batch, per MoE block alpha * sum_e f_e * P_e, with f_e = E / (k N) * tokens of expert e
  and P_e the mean router score of expert e (alpha when perfectly balanced); summed over blocks,
  averaged over the step's micro-batches of all ranks. Its gradient enters
  through the routing weights (`AddAuxLoss`), inside the block's backward, where FSDP has its
  parameters gathered; the hook computing it runs again in a recompute, so checkpointing sees
  the same saved tensors.
- `router.bias_update_rate` = u: the auxiliary-loss-free balancing of DeepSeek-V3 for routers with
  `e_score_correction_bias` (GLM-4.5, MiniMax-M2): after each optimizer step,
  bias += u * sign(mean load - load), from the step's load over all ranks, so every rank applies
  the same update to its shard. The bias is a parameter without gradient: no optimizer touches it.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from tandem.models.moe import MoE
from tandem.trainer.parallel.expert_parallel import moe_blocks


def router_scores(x: torch.Tensor, gate: nn.Module) -> torch.Tensor:
    """x [N, H] -> the router's fp32 scores over all experts [N, E] (what `route` picks its top-k from)."""
    args = gate.args
    logits = F.linear(x.float(), gate.weight.float()) if args.router_fp32 else F.linear(x, gate.weight)
    return logits.float().softmax(-1) if args.score_func == "softmax" else logits.float().sigmoid()


class AddAuxLoss(torch.autograd.Function):
    """Identity on `x`; in backward, gives `aux` the gradient `scale` (so d(total)/d(aux) = scale)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale, ctx.aux_shape = scale, aux.shape
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full(ctx.aux_shape, ctx.scale, dtype=torch.float32, device=grad.device), None


def score_bias_of(moe: MoE) -> nn.Parameter | None:
    """The block's `e_score_correction_bias`, on the router (GLM-4.5) or the block (MiniMax-M2)."""
    if moe.args.score_bias == "router":
        return moe.gate.e_score_correction_bias
    if moe.args.score_bias == "block":
        return moe.e_score_correction_bias
    return None


class RouterMonitor:
    """Hooks on the MoE blocks of one model: statistics, the optional balance loss and bias update."""

    def __init__(self, moes: list[MoE], aux_loss_coef: float, bias_update_rate: float, device: torch.device):
        self.moes = moes
        self.aux_loss_coef = aux_loss_coef
        self.bias_update_rate = bias_update_rate
        num_layers, num_experts = len(moes), moes[0].args.num_experts
        self.load = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=device)
        self.entropy_sum = torch.zeros(num_layers, dtype=torch.float64, device=device)
        self.num_tokens = torch.zeros(num_layers, dtype=torch.float64, device=device)
        self.aux_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.aux_scale = 0.0
        self.num_micro_batches = 0
        self.is_collecting = False
        self.token_weights: torch.Tensor | None = None
        """[N] float64, 1 for the tokens that count, 0 for padding; None: every token counts."""
        for i, moe in enumerate(moes):
            moe.gate.register_forward_hook(functools.partial(self._observe_router, i))

    @contextlib.contextmanager
    def collecting(self, real_tokens: torch.Tensor | None = None) -> Iterator[None]:
        """Count the forwards run inside (training forwards, not their recompute in backward); `real_tokens`
        [N] bool: which of the forward's tokens count (None: all)."""
        self.is_collecting = True
        self.token_weights = None if real_tokens is None else real_tokens.to(torch.float64)
        try:
            yield
        finally:
            self.is_collecting = False
            self.token_weights = None

    def begin_step(self, num_micro_batches: int) -> None:
        """Reset the step's sums; the balance loss is averaged over this many micro-batches per rank."""
        for t in (self.load, self.entropy_sum, self.num_tokens, self.aux_sum):
            t.zero_()
        self.num_micro_batches = num_micro_batches
        self.aux_scale = self.aux_loss_coef / max(num_micro_batches, 1)

    def _observe_router(self, layer: int, gate: nn.Module, inputs: tuple, output: tuple) -> Any:
        x = inputs[0]
        weights, expert_ids = output
        if self.is_collecting:
            with torch.no_grad():
                counts = self.token_weights
                if counts is None:
                    counts = torch.ones(x.shape[0], dtype=torch.float64, device=x.device)
                self.load[layer].scatter_add_(0, expert_ids.reshape(-1), counts[:, None].expand(expert_ids.shape).reshape(-1))
                p = router_scores(x, gate)
                p = p / p.sum(-1, keepdim=True)
                self.entropy_sum[layer] += (-(p * p.clamp_min(1e-20).log()).sum(-1).double() * counts).sum()
                self.num_tokens[layer] += counts.sum()
        if self.aux_loss_coef == 0 or not torch.is_grad_enabled():
            return None
        num_experts = gate.args.num_experts
        counts = torch.zeros(num_experts, device=x.device).scatter_add_(
            0, expert_ids.reshape(-1), torch.ones(expert_ids.numel(), device=x.device))
        fraction = counts * num_experts / expert_ids.numel()  # f_e = E / (k N) * tokens of e
        aux = (fraction * router_scores(x, gate).mean(0)).sum()
        if self.is_collecting:
            self.aux_sum += aux.detach()
        return AddAuxLoss.apply(weights, aux, self.aux_scale), expert_ids

    def end_step(self, update_bias: bool) -> dict[str, Any]:
        """All-reduce the step's sums (one collective, one host copy), apply the bias update when
        `update_bias`, and return the step's metrics."""
        num_layers, num_experts = self.load.shape
        packed = torch.cat([self.load.reshape(-1), self.entropy_sum, self.num_tokens, self.aux_sum.reshape(1)])
        dist.all_reduce(packed)
        if update_bias and self.bias_update_rate > 0:
            self._update_biases(packed[: num_layers * num_experts].view(num_layers, num_experts))
        host = packed.cpu()
        load, entropy_sum, tokens, aux_sum = host.split([num_layers * num_experts, num_layers, num_layers, 1])
        load = load.view(num_layers, num_experts)
        ratio = (load.max(1).values / load.mean(1).clamp_min(1e-12)).tolist()
        entropy = (entropy_sum / tokens.clamp_min(1)).tolist()
        metrics = {"router/tokens_per_expert": load.long().tolist(), "router/max_over_mean": ratio,
                   "router/max_over_mean_worst": max(ratio), "router/entropy_per_layer": entropy,
                   "router/entropy": sum(entropy) / num_layers}
        if self.aux_loss_coef:
            num_micro_batches = max(self.num_micro_batches * dist.get_world_size(), 1)
            metrics["router/aux_loss"] = self.aux_loss_coef * float(aux_sum) / num_micro_batches
        return metrics

    @torch.no_grad()
    def _update_biases(self, load: torch.Tensor) -> None:
        for moe, layer_load in zip(self.moes, load):
            bias = score_bias_of(moe)
            if bias is None:
                continue
            delta = (self.bias_update_rate * torch.sign(layer_load.mean() - layer_load)).to(bias.dtype)
            if isinstance(bias, DTensor):  # every rank has the same delta; each adds its shard of it
                delta = distribute_tensor(delta, bias.device_mesh, bias.placements, src_data_rank=None).to_local()
                bias.to_local().add_(delta)
            else:
                bias.add_(delta)


def build_router_monitor(blocks: nn.ModuleList, aux_loss_coef: float, bias_update_rate: float, device: torch.device,
                         source: str) -> RouterMonitor | None:
    """A monitor over the MoE blocks of `blocks`, or None for a dense model."""
    moes = moe_blocks(blocks)
    if not moes:
        return None
    if bias_update_rate > 0 and all(score_bias_of(moe) is None for moe in moes):
        raise ValueError(f"`router.bias_update_rate` = {bias_update_rate} but the routers of {source} have no "
                         "`e_score_correction_bias` (a GLM-4.5 / MiniMax-M2 router); set it to 0")
    return RouterMonitor(moes, aux_loss_coef, bias_update_rate, device)
