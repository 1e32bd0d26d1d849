"""`lora.share_base` on the trainer's side: the frozen base lives in one shared buffer, laid out for the engine's
stacked projections, and training is bit for bit what it is with the base in tensors of its own (the layout moves
where the values are, not what is computed)."""

from __future__ import annotations

import pytest
import torch

from tandem.config.base import ModelConfig
from tandem.config.lora import LoraConfig
from tandem.config.trainer import AdamWConfig, AIPOLoss, ConstantSchedule, ParallelConfig
from tandem.trainer.loss import build_loss
from tandem.trainer.micro_batch import MicroBatch
from tandem.trainer.model import build_policy
from tandem.trainer.optim import build_optimizer, build_scheduler
from tandem.trainer.parallel.dims import close_parallel, init_parallel
from tandem.trainer.rl.train import rl_objective
from tandem.trainer.step import count_loss_tokens, train_step
from trainer_helpers import random_row

LORA = dict(enabled=True, rank=4, alpha=8.0)


@pytest.fixture
def dims():
    d = init_parallel("cpu")
    yield d
    close_parallel()


def train(model, dims, share_base: bool, steps: int = 2) -> tuple[list[tuple[float, float]], dict[str, torch.Tensor], object]:
    """`steps` RL steps of a bf16 LoRA policy; the (loss, grad norm) of each, the adapters after, and the policy."""
    policy, _ = build_policy(ModelConfig(name=str(model), dtype="bfloat16"), ParallelConfig(), dims, chunk_size=4,
                             lora=LoraConfig(**LORA, share_base=share_base))
    optimizer = build_optimizer(policy, AdamWConfig(lr=1e-2))
    scheduler = build_scheduler(optimizer, ConstantSchedule(), steps)
    objective = rl_objective(build_loss(AIPOLoss()))
    results = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        mbs = [MicroBatch.from_row(random_row(gen, [(3, 5), (2, 9)]), dims.device)]
        result = train_step(policy, optimizer, scheduler, mbs, objective, count_loss_tokens(mbs, dims), 0.5, dims)
        results.append((result.loss, result.grad_norm))
    return results, {name: p.detach().clone() for name, p in policy.adapter_parameters()}, policy


def test_a_shared_base_trains_bit_for_bit_like_its_own(tiny_model, dims):
    own_results, own_adapters, _ = train(tiny_model, dims, share_base=False)
    shared_results, shared_adapters, policy = train(tiny_model, dims, share_base=True)
    assert shared_results == own_results
    assert shared_adapters.keys() == own_adapters.keys()
    assert all(torch.equal(shared_adapters[name], own_adapters[name]) for name in own_adapters)
    buffer = policy.shared_base.buffer.tensor
    start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
    frozen = policy.hf_named_parameters()
    assert frozen and all(start <= p.data_ptr() and p.data_ptr() + p.nbytes <= end for _, p in frozen)
    attention = policy.lm.model.layers[0].self_attn
    q, k, v = (attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight)
    assert k.data_ptr() == q.data_ptr() + q.nbytes and v.data_ptr() == k.data_ptr() + k.nbytes
    policy.shared_base.buffer.remove()


def test_a_trainer_with_fsdp_refuses_to_share_its_base(tiny_model, dims):
    with pytest.raises(ValueError, match=r"`lora.share_base` needs the trainer on one rank without FSDP"):
        build_policy(ModelConfig(name=str(tiny_model)), ParallelConfig(fsdp_at_one_rank=True), dims, chunk_size=4,
                     lora=LoraConfig(**LORA, share_base=True))
