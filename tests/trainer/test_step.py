"""One optimizer step: the update is the gradient of the global token mean; padding rows are harmless."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.config.base import ModelConfig
from tandem.config.trainer import AIPOLoss, ParallelConfig, SGDConfig, ConstantSchedule
from tandem.trainer.micro_batch import MicroBatch
from tandem.trainer.loss import build_loss
from tandem.trainer.model import build_policy
from tandem.trainer.optim import build_optimizer, build_scheduler
from tandem.trainer.parallel.dims import close_parallel, init_parallel
from tandem.trainer.rl.train import rl_objective
from tandem.trainer.sft.data import padding_row
from tandem.trainer.step import accumulate_gradients, count_loss_tokens, evaluate, skips_on_device, train_step

from trainer_helpers import random_row


@pytest.fixture
def dims():
    d = init_parallel("cpu")
    yield d
    close_parallel()


def test_update_is_the_gradient_of_the_global_token_mean(tiny_model, dims):
    gen = torch.Generator().manual_seed(0)
    rows = [random_row(gen, [(3, 5), (2, 9)]), random_row(gen, [(4, 3)]), padding_row(259)]
    micro_batches = [MicroBatch.from_row(r, dims.device) for r in rows]
    objective = rl_objective(build_loss(AIPOLoss()))
    n = count_loss_tokens(micro_batches, dims)
    assert n == 5 + 9 + 3

    reference, _ = build_policy(ModelConfig(name=str(tiny_model)), ParallelConfig(), dims, chunk_size=4)
    total = sum(objective(mb, reference(mb.input_ids, mb.position_ids, mb.temperatures, mb.loss_mask)).loss_sum for mb in micro_batches)
    (total / n).backward()
    expected = {name: -p.grad for name, p in reference.hf_named_parameters()}

    policy, _ = build_policy(ModelConfig(name=str(tiny_model)), ParallelConfig(), dims, chunk_size=4)
    before = {name: p.detach().clone() for name, p in policy.hf_named_parameters()}
    optimizer = build_optimizer(policy, SGDConfig(lr=1.0, max_grad_norm=0))
    result = train_step(policy, optimizer, build_scheduler(optimizer, ConstantSchedule(), 1), micro_batches, objective, n, 0.0, dims)
    assert not result.skipped and result.loss == pytest.approx(total.detach().item() / n, rel=1e-6)
    for name, p in policy.hf_named_parameters():
        torch.testing.assert_close(p.detach() - before[name], expected[name], rtol=1e-4, atol=1e-6)


def test_gradient_clipping_bounds_the_update(tiny_model, dims):
    gen = torch.Generator().manual_seed(0)
    micro_batches = [MicroBatch.from_row(random_row(gen, [(3, 20)], advantage_scale=100.0), dims.device)]
    objective = rl_objective(build_loss(AIPOLoss()))
    policy, _ = build_policy(ModelConfig(name=str(tiny_model)), ParallelConfig(), dims, chunk_size=8)
    before = torch.cat([p.detach().flatten() for _, p in policy.hf_named_parameters()])
    optimizer = build_optimizer(policy, SGDConfig(lr=1.0))
    result = train_step(policy, optimizer, build_scheduler(optimizer, ConstantSchedule(), 1), micro_batches, objective, 20, 0.5, dims)
    after = torch.cat([p.detach().flatten() for _, p in policy.hf_named_parameters()])
    assert result.grad_norm > 0.5
    assert (after - before).norm().item() == pytest.approx(0.5, rel=1e-4)


def test_evaluate_is_the_mean_over_loss_tokens_and_ignores_padding(tiny_model, dims):
    from tandem.trainer.sft.train import sft_objective

    gen = torch.Generator().manual_seed(1)
    rows = [random_row(gen, [(2, 6)]), random_row(gen, [(3, 4)])]
    policy, _ = build_policy(ModelConfig(name=str(tiny_model)), ParallelConfig(), dims, chunk_size=8)
    plain = evaluate(policy, [MicroBatch.from_row(r, dims.device) for r in rows], sft_objective, dims)
    padded = evaluate(policy, [MicroBatch.from_row(r, dims.device) for r in rows + [padding_row(259)]], sft_objective, dims)
    assert plain == pytest.approx(padded) and plain == pytest.approx(5.56, abs=0.3)


def test_mismatch_kl_counts_only_tokens_of_the_trained_policy(tiny_model, dims):
    """Tokens sampled by the weights being trained measure the numeric trainer-inference gap;
    older tokens measure drift and go to `off_policy_kl`."""
    from tandem.trainer.rl.train import kl_metrics
    from tandem.trainer.loss import LossInputs, mismatch_kl

    gen = torch.Generator().manual_seed(3)
    policy, _ = build_policy(ModelConfig(name=str(tiny_model)), ParallelConfig(), dims, chunk_size=8)
    row = random_row(gen, [(3, 6), (2, 5)])
    mb = MicroBatch.from_row(row, dims.device)
    with torch.no_grad():
        true_logprobs = policy(mb.input_ids, mb.position_ids, mb.temperatures, mb.loss_mask).logprobs
    # sample 1 was sampled by policy 4 (the trained one) with exact logprobs; sample 2 by policy 3
    row.logprobs = [lp if m else 0.0 for lp, m in zip(true_logprobs[0].tolist(), row.loss_mask)]
    row.logprobs[9 + 2:] = [lp - 0.5 for lp in row.logprobs[9 + 2:]]
    row.policy_versions = [4] * 9 + [3] * 7
    mb = MicroBatch.from_row(row, dims.device, policy_version=4)
    assert mb.on_policy[0].tolist() == [True] * 9 + [False] * 7
    out = rl_objective(build_loss(AIPOLoss()))(mb, policy(mb.input_ids, mb.position_ids, mb.temperatures, mb.loss_mask))
    n = 11
    kls = kl_metrics({k: float(v) / n for k, v in out.metric_sums.items()})
    assert kls["on_policy_fraction"] == pytest.approx(6 / 11)
    assert kls["mismatch_kl"] == pytest.approx(0.0, abs=1e-6)
    expected_off = mismatch_kl(LossInputs(torch.zeros(5), torch.full((5,), -0.5), torch.zeros(5), torch.ones(5, dtype=torch.bool))).mean()
    assert kls["off_policy_kl"] == pytest.approx(float(expected_off), rel=1e-4)


def test_fused_adamw_drops_a_non_finite_step_on_the_device_and_takes_a_finite_one_as_before(tiny_model, dims):
    """With fused AdamW on plain tensors the update is launched before the host reads the NaN guard's test
    (`skips_on_device`): a non-finite step changes no weight, moment or step count; a finite one gives the
    weights of reading the test first, bit for bit. Fused AdamW runs on a CPU too, so the path is tested here."""
    gen = torch.Generator().manual_seed(0)
    finite, blown_up = ([MicroBatch.from_row(random_row(gen, [(4, 8)], advantage_scale=scale), dims.device)]
                        for scale in (1.0, 3e38))  # 3e38: finite advantages whose sum overflows fp32
    objective = rl_objective(build_loss(AIPOLoss()))

    def fresh(fused: bool):
        policy, _ = build_policy(ModelConfig(name=str(tiny_model)), ParallelConfig(), dims, chunk_size=8)
        optimizer = torch.optim.AdamW([p for _, p in policy.hf_named_parameters()], lr=1e-2, fused=fused)
        return policy, optimizer, build_scheduler(optimizer, ConstantSchedule(), 3)

    policy, optimizer, scheduler = fresh(fused=True)
    reference, reference_optimizer, reference_scheduler = fresh(fused=True)
    assert skips_on_device(optimizer) and not skips_on_device(fresh(fused=False)[1])
    for batch in (finite, blown_up, finite):
        result = train_step(policy, optimizer, scheduler, batch, objective, 8, 1.0, dims)
        grads = accumulate_gradients(reference, batch, objective, 8, 1.0, dims)  # the test read first, then the update
        skipped = not (math.isfinite(grads.loss) and math.isfinite(grads.grad_norm))
        if not skipped:
            reference_optimizer.step()
        reference_optimizer.zero_grad(set_to_none=True)
        reference_scheduler.step()
        assert result.skipped == skipped == (batch is blown_up)
        for p, q in zip(optimizer.param_groups[0]["params"], reference_optimizer.param_groups[0]["params"]):
            assert torch.equal(p, q)
            assert optimizer.state[p].keys() == reference_optimizer.state[q].keys()
            assert all(torch.equal(v, reference_optimizer.state[q][k]) for k, v in optimizer.state[p].items())
    assert {state["step"].item() for state in optimizer.state.values()} == {2.0}  # the blown-up step did not count
    assert not hasattr(optimizer, "found_inf")
