"""One optimizer step over a rank's micro-batches, shared by the RL and SFT trainers.

Normalization: each micro-batch contributes `sum(per-token loss over its loss tokens) / N`, N the
loss tokens of the whole step over all ranks. FSDP averages gradients over the `dp_size` ranks,
so the backward scales by `dp_size / N`: the update is the gradient of the global token mean,
the same at any world size.

NaN guard: a step whose loss or gradient norm is not finite is skipped (no optimizer update, the
gradients are dropped) and reported; the scheduler still advances so the schedule stays a
function of the step index. With fused AdamW on one rank the update is launched before the host
reads the test, which the optimizer then reads on the device (`skips_on_device`): the device does
not wait, between backward and the update, for the host to read the figures and then launch the
optimizer (`benchmarks/results/trainer-h100-2026-12-05-guard-addmm.json`; a shorter wait remains
where the host is still launching the optimizer when the device finishes backward).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tandem.models.moe import replayed_routing
from tandem.trainer.micro_batch import MicroBatch
from tandem.trainer.model import PolicyModel, TokenLogprobs
from tandem.trainer.mtp import MtpLoss
from tandem.trainer.parallel.dims import ParallelDims
from tandem.trainer.phases import phase


@dataclass
class ObjectiveOutput:
    loss_sum: torch.Tensor
    """Sum of the per-token loss over the micro-batch's loss tokens (carries the gradient)."""
    metric_sums: dict[str, torch.Tensor]
    """Sums over loss tokens of per-token quantities to log as means (same keys on every call)."""
    mtp: MtpLoss | None = None
    """The multi-token prediction layer's loss (`mtp.train`), which `forward_objective` adds: backward runs through
    it beside the objective's, whose gradients it leaves as they are (`tandem.trainer.mtp`)."""


Objective = Callable[[MicroBatch, TokenLogprobs], ObjectiveOutput]


@dataclass
class StepResult:
    loss: float
    """Global mean loss per loss token."""
    grad_norm: float
    """Global gradient norm before clipping."""
    lr: float
    """Learning rate this step used."""
    skipped: bool
    """True when the NaN guard skipped the update."""
    metrics: dict[str, float]
    """Global means over loss tokens: entropy and the objective's metrics."""
    router: dict[str, Any]
    """MoE router statistics of the step over all ranks (`tandem.trainer.router`); empty for a dense model."""


def global_sum(values: list[float], dims: ParallelDims) -> list[float]:
    """Element-wise sum over all ranks."""
    t = torch.tensor(values, dtype=torch.float64, device=dims.device)
    dist.all_reduce(t)
    return t.tolist()


def count_loss_tokens(micro_batches: list[MicroBatch], dims: ParallelDims) -> int:
    """Loss tokens of the step over all ranks."""
    local = float(sum(int(mb.loss_mask.sum()) for mb in micro_batches))
    return int(global_sum([local], dims)[0])


def forward_objective(model: PolicyModel, mb: MicroBatch, objective: Objective) -> tuple[ObjectiveOutput, torch.Tensor]:
    """Objective and entropy sum of one micro-batch."""
    out = model(mb.input_ids, mb.position_ids, mb.temperatures, mb.loss_mask, mb.row_document_lengths, mb.context,
                mb.predicting_positions)
    with phase("objective"):
        result = objective(mb, out)
        result.mtp = out.mtp
        entropy_sum = torch.where(mb.loss_mask, out.entropy, 0.0).sum()
    return result, entropy_sum


def maybe_replayed_routing(model: PolicyModel, mb: MicroBatch) -> contextlib.AbstractContextManager:
    """The micro-batch's routed experts replayed by the model's MoE layers (router replay), if it has any."""
    if mb.routed_experts is None:
        return contextlib.nullcontext()
    return replayed_routing(model.lm, mb.routed_experts)


@dataclass
class Gradients:
    """What one forward/backward pass over a step's micro-batches leaves: the gradients sit in `.grad`."""

    loss: float
    """Global mean loss per loss token."""
    grad_norm: float
    """Global gradient norm before clipping."""
    metrics: dict[str, float]
    """Global means over loss tokens: entropy and the objective's metrics."""


def accumulate_gradients(model: PolicyModel, micro_batches: list[MicroBatch], objective: Objective, num_loss_tokens: int,
                         max_grad_norm: float, dims: ParallelDims) -> Gradients:
    """Forward/backward every micro-batch and clip (max_grad_norm 0: no clipping); the update is the caller's.
    Every rank must pass the same number of micro-batches. `tandem replay` calls it alone, so a replayed step
    computes its loss and gradient norm through the very code of training."""
    return read_figures(gradients_on_device(model, micro_batches, objective, num_loss_tokens, max_grad_norm, dims),
                        num_loss_tokens)


@dataclass
class StepFigures:
    """A step's figures while they are still on the device."""

    keys: list[str]
    """The metric sums' names, in the order of `values`."""
    values: torch.Tensor
    """The metric sums over all ranks, then the gradient norms: float64 [len(keys) + len(norm_keys)] on the device."""
    norm_keys: list[str] = field(default_factory=lambda: ["grad_norm"])
    """The gradient norms' names, in the order of `values`: the MTP layer's (`mtp/grad_norm`) where it trains, then
    the policy's (`grad_norm`)."""

    def finite(self) -> torch.Tensor:
        """Whether the loss and the gradient norms are finite (the NaN guard's test): a 0-d bool on the device."""
        return torch.isfinite(self.values[[self.keys.index("loss"), *range(len(self.keys), self.values.numel())]]).all()


def gradients_on_device(model: PolicyModel, micro_batches: list[MicroBatch], objective: Objective, num_loss_tokens: int,
                        max_grad_norm: float, dims: ParallelDims) -> StepFigures:
    """`accumulate_gradients` without reading its figures: the host waits for nothing.

    The metric sums stay on the device and are reduced over the ranks there, to be read with the gradient norm in
    one transfer (`read_figures`): each read is a wait for the device to drain."""
    scale = dims.dp_size / max(num_loss_tokens, 1)
    totals: dict[str, torch.Tensor] = {}
    router = model.router
    for mb in micro_batches:
        collecting = contextlib.nullcontext() if router is None else router.collecting(
            mb.context.real_tokens() if mb.context else None)
        with maybe_replayed_routing(model, mb):  # backward too: activation checkpointing routes again
            with collecting, phase("forward"):
                result, entropy_sum = forward_objective(model, mb, objective)
            with phase("backward"):
                loss = result.loss_sum * scale
                (loss if result.mtp is None else loss + result.mtp.loss_sum * scale).backward()
        with phase("metrics"):
            sums = {"loss": result.loss_sum.detach(), "entropy": entropy_sum, **result.metric_sums,
                    **(result.mtp.metric_sums() if result.mtp is not None else {})}
            for key, value in sums.items():
                totals[key] = totals.get(key, 0.0) + value.detach().double()
    with phase("grad_clip"):
        norms = {"grad_norm": clip_grad_norm(policy_parameters(model), max_grad_norm)}
        if model.mtp_parameters:  # apart: the MTP layer's gradients must not change how the policy's are clipped
            norms["mtp/grad_norm"] = clip_grad_norm(model.mtp_parameters, max_grad_norm)
    with phase("metrics"):
        keys = sorted(totals)
        reduced = torch.stack([totals[k] for k in keys])
        dist.all_reduce(reduced)
    norm_keys = sorted(norms, key=lambda k: k == "grad_norm")
    return StepFigures(keys, torch.cat([reduced, torch.stack([norms[k] for k in norm_keys]).double()]), norm_keys)


def policy_parameters(model: PolicyModel) -> Iterable[torch.nn.Parameter]:
    """The parameters the policy's gradient norm covers: all but a training MTP layer's (filtered only then)."""
    if not model.mtp_parameters:
        return model.parameters()
    mtp = {id(p) for p in model.mtp_parameters}
    return [p for p in model.parameters() if id(p) not in mtp]


def read_figures(figures: StepFigures, num_loss_tokens: int) -> Gradients:
    """The step's figures on the host: one transfer, which waits for all the work launched before it."""
    with phase("metrics_transfer"):
        values = figures.values.tolist()
    means = {k: v / max(num_loss_tokens, 1) for k, v in zip(figures.keys, values)}
    norms = dict(zip(figures.norm_keys, values[len(figures.keys):]))
    if "mtp/loss_sum" in means:  # a mean over the positions the MTP layer predicts, not over the loss tokens
        means["mtp/loss"] = means.pop("mtp/loss_sum") / max(means.pop("mtp/tokens"), 1e-30)
    return Gradients(loss=means.pop("loss"), grad_norm=norms.pop("grad_norm"), metrics=means | norms)


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer can drop its own update on the device: fused AdamW reads a 0-d `found_inf` (1: no
    parameter, moment or step count changes). Then the host launches the update before it reads the NaN
    guard's test, instead of the device waiting for that read. Plain tensors only (one rank without FSDP):
    elsewhere the host reads the figures first."""
    return (isinstance(optimizer, torch.optim.Adam) and all(group.get("fused") for group in optimizer.param_groups)
            and not any(isinstance(p, DTensor) for group in optimizer.param_groups for p in group["params"]))


def train_step(model: PolicyModel, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
               micro_batches: list[MicroBatch], objective: Objective, num_loss_tokens: int, max_grad_norm: float,
               dims: ParallelDims) -> StepResult:
    """Forward/backward every micro-batch, clip, guard, step. Every rank must pass the same number of micro-batches."""
    router = model.router
    if router is not None:
        router.begin_step(len(micro_batches))
    figures = gradients_on_device(model, micro_batches, objective, num_loss_tokens, max_grad_norm, dims)
    on_device = skips_on_device(optimizer)
    if on_device:
        with phase("optimizer"):
            optimizer.found_inf = (~figures.finite()).float()
            try:
                optimizer.step()
            finally:
                del optimizer.found_inf
    grads = read_figures(figures, num_loss_tokens)
    skipped = not (math.isfinite(grads.loss) and math.isfinite(grads.grad_norm))
    if not on_device:
        with phase("optimizer"):
            if not skipped:
                optimizer.step()
    with phase("zero_grad"):
        optimizer.zero_grad(set_to_none=True)
    with phase("schedule"):
        router_metrics = router.end_step(update_bias=not skipped) if router is not None else {}
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
    return StepResult(loss=grads.loss, grad_norm=grads.grad_norm, lr=lr, skipped=skipped, metrics=grads.metrics,
                      router=router_metrics)


@torch.no_grad()
def evaluate(model: PolicyModel, micro_batches: list[MicroBatch], objective: Objective, dims: ParallelDims) -> float:
    """Global mean loss per loss token, without gradients. Every rank must pass the same number of micro-batches."""
    was_training = model.training
    model.eval()
    total = 0.0
    for mb in micro_batches:
        with maybe_replayed_routing(model, mb):
            result, _ = forward_objective(model, mb, objective)
        total += float(result.loss_sum)
    model.train(was_training)
    loss_sum, tokens = global_sum([total, float(sum(int(mb.loss_mask.sum()) for mb in micro_batches))], dims)
    return loss_sum / max(tokens, 1)


def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Global L2 norm of the (sharded) gradients of `parameters` as a 0-d fp32 tensor on the device, and the gradients
    clipped to `max_norm` when it is > 0.

    No sync: the gradients are always multiplied by min(1, max_norm / (norm + 1e-6)), which is exactly 1
    below the bound. A non-finite norm makes them non-finite or zero, which changes nothing: the NaN
    guard then drops them. Gradients on different device meshes (expert parallelism puts the routed
    experts on their own mesh) cannot meet in one DTensor op: each mesh's norm is completed over its
    mesh, then combined."""
    by_mesh: dict[object, list[torch.nn.Parameter]] = {}
    for p in parameters:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    norms = []
    for params in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)  # local norms combined over the mesh
    norm = torch.linalg.vector_norm(torch.stack(norms))
    if max_norm > 0:
        for params in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm.detach().float()
