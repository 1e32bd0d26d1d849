"""Off-policy RL losses, chosen by `loss.type`.

A loss is a function of per-token tensors (`LossInputs`) that returns a per-token loss and
per-token indicators to log (`LossOutput`). It neither masks nor normalizes: the trainer keeps
the loss tokens and divides their sum by the number of loss tokens of the whole global batch
(all micro-batches of all ranks), so every token weighs the same whatever rank or row it is in.

Notation: logp_theta the trainer's logprob (with gradient), logp_mu the inference server's,
r = exp(logp_theta - logp_mu) the importance ratio, A the advantage.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from tandem.config.trainer import AIPOLoss, CustomLoss, DPPOKLLoss, LossConfig, PPOClipLoss


@dataclass
class LossInputs:
    """Same-shape tensors; only positions where `loss_mask` is true count."""

    logprobs: torch.Tensor
    """Trainer logprobs of the sampled tokens (carry the gradient)."""
    inference_logprobs: torch.Tensor
    """Logprobs the inference server reported when it sampled the tokens."""
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    """Bool: the tokens the policy sampled."""


@dataclass
class LossOutput:
    per_token: torch.Tensor
    """Loss of each token; the trainer sums it over loss tokens and divides by the global count."""
    fractions: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per-token 0/1 indicators (clipped, masked), logged as their mean over loss tokens."""


LossFn = Callable[[LossInputs], LossOutput]


def aipo_loss(x: LossInputs, delta: float) -> LossOutput:
    """`-min(r, delta) * A`: truncated importance sampling. Below delta the gradient is
    `-A * r * grad(logp_theta)`; above it the token gives none (the ratio is clipped)."""
    ratio = torch.exp(x.logprobs - x.inference_logprobs)
    clipped = ratio > delta
    return LossOutput(-torch.clamp(ratio, max=delta) * x.advantages, {"clipped_fraction": clipped.float()})


def dppo_kl_loss(x: LossInputs, delta: float, kl_tau: float) -> LossOutput:
    """`-r * A` on tokens whose probability moved less than `delta` in the advantage's direction,
    masked otherwise (no gradient), plus `kl_tau * (log r)^2` on every token."""
    log_ratio = x.logprobs - x.inference_logprobs
    ratio = torch.exp(log_ratio)
    prob_diff = (torch.exp(x.logprobs) - torch.exp(x.inference_logprobs)).detach()
    positive = x.advantages > 0
    masked = (positive & (prob_diff > delta)) | (~positive & (prob_diff < -delta))
    policy_term = torch.where(masked, torch.zeros_like(ratio), -ratio * x.advantages)
    return LossOutput(policy_term + kl_tau * log_ratio.square(), {"masked_fraction": masked.float()})


def ppo_clip_loss(x: LossInputs, clip_low: float, clip_high: float) -> LossOutput:
    """PPO's pessimistic surrogate `-min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)`."""
    ratio = torch.exp(x.logprobs - x.inference_logprobs)
    unclipped = ratio * x.advantages
    clipped_term = torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * x.advantages
    clipped = clipped_term < unclipped  # the clipped branch is the minimum: no gradient
    return LossOutput(-torch.minimum(unclipped, clipped_term), {"clipped_fraction": clipped.float()})


def mismatch_kl(x: LossInputs) -> torch.Tensor:
    """Per-token k3 estimate of KL(mu || pi_theta) from tokens sampled by mu: r - 1 - log r, never negative.
    Written expm1(log r) - log r: exp(log r) - 1 - log r cancels to tiny negatives in fp32 when r is near 1
    (the preflight printed them), and the clamp removes the last rounding below 0."""
    log_ratio = (x.logprobs - x.inference_logprobs).detach()
    return (torch.expm1(log_ratio) - log_ratio).clamp_min(0.0)


def build_loss(config: LossConfig) -> LossFn:
    """The loss function of `config`; a custom one is imported now, so a bad path fails at start."""
    if isinstance(config, AIPOLoss):
        return lambda x: aipo_loss(x, config.delta)
    if isinstance(config, DPPOKLLoss):
        return lambda x: dppo_kl_loss(x, config.delta, config.kl_tau)
    if isinstance(config, PPOClipLoss):
        return lambda x: ppo_clip_loss(x, config.clip_low, config.clip_high)
    if isinstance(config, CustomLoss):
        fn = import_function(config.path)
        return lambda x: fn(x, **config.kwargs)
    raise ValueError(f"unknown loss type {getattr(config, 'type', config)!r}")


def import_function(path: str) -> Callable:
    """`package.module:function` -> the function, with an error naming `loss.path` if it fails."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"`loss.path` = {path!r}: expected `package.module:function`")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"`loss.path` = {path!r}: cannot import {module_name}: {err}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"`loss.path` = {path!r}: {module_name} has no function {attr!r}")
    return fn
