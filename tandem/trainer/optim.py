"""Optimizers (AdamW, SGD) and learning-rate schedules (constant, linear, cosine; linear warmup).

The schedule is a function of the step index only (`LambdaLR`), so it is restored exactly by
loading the scheduler's state, whatever happened at earlier steps (a skipped step still advances it).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tandem.config.trainer import AdamWConfig, ConstantSchedule, CosineSchedule, LinearSchedule, OptimConfig, SGDConfig, SchedulerConfig


def param_groups(model: nn.Module) -> list[dict]:
    """Trainable parameters, one group per device mesh: a group's foreach kernels cannot mix
    DTensors of different meshes (expert parallelism puts the routed experts on their own)."""
    groups: dict[object, list[nn.Parameter]] = {}
    for p in model.parameters():
        if p.requires_grad:
            groups.setdefault(getattr(p, "device_mesh", None), []).append(p)
    return [{"params": params} for params in groups.values()]


def build_optimizer(model: nn.Module, config: OptimConfig) -> torch.optim.Optimizer:
    groups = param_groups(model)
    params = [p for group in groups for p in group["params"]]
    if isinstance(config, AdamWConfig):
        # CUDA: one fused kernel over all parameters; elsewhere the foreach implementation.
        fused = all(p.device.type == "cuda" for p in params)
        return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay,
                                 fused=fused or None)
    if isinstance(config, SGDConfig):
        return torch.optim.SGD(groups, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)
    raise ValueError(f"unknown optimizer type {getattr(config, 'type', config)!r}")


def lr_factor(config: SchedulerConfig, step: int, max_steps: int) -> float:
    """Multiplier of the peak learning rate at optimizer step `step` (0-indexed)."""
    if step < config.warmup_steps:
        return (step + 1) / (config.warmup_steps + 1)
    if isinstance(config, ConstantSchedule):
        return 1.0
    decay_steps = max(max_steps - config.warmup_steps, 1)
    progress = min((step - config.warmup_steps) / decay_steps, 1.0)
    if isinstance(config, LinearSchedule):
        shape = 1.0 - progress
    elif isinstance(config, CosineSchedule):
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown scheduler type {getattr(config, 'type', config)!r}")
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, config: SchedulerConfig, max_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(config, step, max_steps))
