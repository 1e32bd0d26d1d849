"""Each RL loss against a hand-written per-token reference: values, gradients, clipped/masked tokens."""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch

from tandem.config.trainer import AIPOLoss, CustomLoss, DPPOKLLoss, PPOClipLoss
from tandem.trainer.loss import LossInputs, LossOutput, build_loss, mismatch_kl

# (logp_theta, logp_mu, advantage): ratios on both sides of every threshold used below.
TOKENS = [
    (-1.0, -1.0, 1.0),    # r = 1
    (-0.2, -2.5, 2.0),    # r = e^2.3 ~ 9.97 > 8: clipped by aipo; p_theta - p_mu ~ 0.74, A > 0
    (-3.0, -1.0, -1.0),   # r = e^-2 ~ 0.135, A < 0
    (-0.5, -0.9, 0.5),    # r = e^0.4 ~ 1.49, p_theta - p_mu ~ 0.200 (just below 0.2 -> not masked)
    (-0.1, -1.2, 1.5),    # p_theta - p_mu ~ 0.604 > 0.2, A > 0: masked by dppo
    (-2.0, -0.3, -0.7),   # p_theta - p_mu ~ -0.605 < -0.2, A <= 0: masked by dppo
    (-2.0, -0.3, 0.7),    # same probabilities, A > 0: not masked
    (-1.6, -1.3, 0.0),    # A = 0
]


def inputs() -> LossInputs:
    lp, mu, adv = (torch.tensor(c, dtype=torch.float64) for c in zip(*TOKENS))
    return LossInputs(lp.clone().requires_grad_(True), mu, adv, torch.ones(len(TOKENS), dtype=torch.bool))


def value_and_grad(loss_fn) -> tuple[list[float], list[float], LossOutput]:
    x = inputs()
    out = loss_fn(x)
    (grad,) = torch.autograd.grad(out.per_token.sum(), x.logprobs)
    return out.per_token.tolist(), grad.tolist(), out


def reference_aipo(lp, mu, a, delta):
    r = math.exp(lp - mu)
    return -min(r, delta) * a, (-a * r if r < delta else 0.0), r > delta


def reference_dppo(lp, mu, a, delta, tau):
    r, log_r = math.exp(lp - mu), lp - mu
    diff = math.exp(lp) - math.exp(mu)
    masked = (a > 0 and diff > delta) or (a <= 0 and diff < -delta)
    value = (0.0 if masked else -r * a) + tau * log_r ** 2
    grad = (0.0 if masked else -r * a) + 2 * tau * log_r
    return value, grad, masked


def reference_ppo(lp, mu, a, low, high):
    r = math.exp(lp - mu)
    unclipped, clipped = r * a, min(max(r, 1 - low), 1 + high) * a
    is_clipped = clipped < unclipped
    return -min(unclipped, clipped), (0.0 if is_clipped else -r * a), is_clipped


@pytest.mark.parametrize("config, reference, fraction", [
    (AIPOLoss(), lambda t: reference_aipo(*t, 8.0), "clipped_fraction"),
    (AIPOLoss(delta=1.2), lambda t: reference_aipo(*t, 1.2), "clipped_fraction"),
    (DPPOKLLoss(), lambda t: reference_dppo(*t, 0.2, 1e-3), "masked_fraction"),
    (DPPOKLLoss(delta=0.5, kl_tau=0.1), lambda t: reference_dppo(*t, 0.5, 0.1), "masked_fraction"),
    (PPOClipLoss(), lambda t: reference_ppo(*t, 0.2, 0.2), "clipped_fraction"),
    (PPOClipLoss(clip_low=0.1, clip_high=0.28), lambda t: reference_ppo(*t, 0.1, 0.28), "clipped_fraction"),
], ids=["aipo", "aipo-delta", "dppo_kl", "dppo_kl-custom", "ppo_clip", "ppo_clip-asym"])
def test_loss_matches_hand_written_reference(config, reference, fraction):
    values, grads, out = value_and_grad(build_loss(config))
    expected = [reference(t) for t in TOKENS]
    assert values == pytest.approx([e[0] for e in expected], abs=1e-12)
    assert grads == pytest.approx([e[1] for e in expected], abs=1e-12)
    assert out.fractions[fraction].tolist() == [float(e[2]) for e in expected]
    assert 0 < sum(e[2] for e in expected) < len(TOKENS)  # the example exercises both branches


def test_example_hits_the_dppo_mask_on_both_signs():
    _, _, out = value_and_grad(build_loss(DPPOKLLoss()))
    # token 1: +0.74 with A > 0; token 2: -0.32 with A < 0; token 3: +0.1999 stays; token 6: A > 0 going down stays
    assert out.fractions["masked_fraction"].tolist() == [0, 1, 1, 0, 1, 1, 0, 0]


def test_mismatch_kl_is_the_k3_estimator():
    x = inputs()
    expected = [math.exp(lp - mu) - 1 - (lp - mu) for lp, mu, _ in TOKENS]
    assert mismatch_kl(x).tolist() == pytest.approx(expected, abs=1e-12)


def test_mismatch_kl_is_never_negative_near_a_ratio_of_one():
    # exp(r) - 1 - r cancels to negatives in fp32 for |r| of a few 1e-4 and below; the estimator is >= 0
    log_ratio = torch.linspace(-3e-3, 3e-3, 2001)
    naive = torch.exp(log_ratio) - 1 - log_ratio
    assert (naive < 0).any()  # the rounding this guards against
    x = LossInputs(log_ratio, torch.zeros_like(log_ratio), torch.zeros_like(log_ratio), torch.ones(2001, dtype=torch.bool))
    k3 = mismatch_kl(x)
    assert (k3 >= 0).all()
    torch.testing.assert_close(k3.double(), (log_ratio.double().exp() - 1 - log_ratio.double()), atol=2e-10, rtol=0)


def test_mismatch_kl_averages_to_the_exact_kl_under_the_sampling_policy():
    # Every token of a 4-token vocabulary, weighted by how often mu samples it: the k3 estimator's
    # mean under mu is exactly KL(mu || pi_theta) (a flipped ratio would give a different number).
    mu = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    pi = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64)
    x = LossInputs(pi.log(), mu.log(), torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.bool))
    exact = float((mu * (mu / pi).log()).sum())
    assert float((mu * mismatch_kl(x)).sum()) == pytest.approx(exact, abs=1e-12)
    assert exact > 0.1  # the two policies differ enough for the check to mean something


def test_custom_loss_is_imported_and_given_its_kwargs(monkeypatch):
    module = types.ModuleType("my_losses")

    def scaled_pg(x: LossInputs, scale: float) -> LossOutput:
        return LossOutput(-scale * x.logprobs * x.advantages)

    module.scaled_pg = scaled_pg
    monkeypatch.setitem(sys.modules, "my_losses", module)
    values, grads, _ = value_and_grad(build_loss(CustomLoss(path="my_losses:scaled_pg", kwargs={"scale": 3.0})))
    assert grads == pytest.approx([-3.0 * a for _, _, a in TOKENS])
    assert values == pytest.approx([-3.0 * lp * a for lp, _, a in TOKENS])


@pytest.mark.parametrize("path, message", [
    ("no_colon", "expected `package.module:function`"),
    ("tandem_no_such_module:f", "cannot import"),
    ("math:no_such_function", "has no function"),
])
def test_bad_custom_loss_path_is_a_clear_error(path, message):
    with pytest.raises(ValueError, match=message):
        build_loss(CustomLoss(path=path))
