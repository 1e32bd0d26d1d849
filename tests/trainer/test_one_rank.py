"""The one-rank path (plain tensors, `tandem.trainer.parallel.one_rank`) trains bit for bit like FSDP2 at one rank.

Bitwise, not within a tolerance: both paths round the same values the same way (the fp32 -> bf16 cast of
the masters, bf16 gradients added into fp32 ones, the same AdamW and clipping kernels on the same fp32
numbers), so any difference is a defect. bf16 on the CPU exercises the compute copies; fp32 the plain module.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from tandem.config.base import ModelConfig
from tandem.config.lora import LoraConfig
from tandem.config.trainer import ActivationCheckpointConfig, AdamWConfig, AIPOLoss, ConstantSchedule, KernelsConfig, ParallelConfig
from tandem.models.loading import load_causal_lm
from tandem.models.moe import fp32_router_parameters, fp32_routers
from tandem.trainer.micro_batch import MicroBatch
from tandem.trainer.checkpoint import load_checkpoint, save_checkpoint
from tandem.trainer.loss import build_loss
from tandem.trainer.model import announced_state, build_policy, gather_full_state
from tandem.trainer.optim import build_optimizer, build_scheduler
from tandem.trainer.parallel.dims import close_parallel, init_parallel
from tandem.trainer.rl.train import rl_objective
from tandem.trainer.step import count_loss_tokens, evaluate, train_step

from test_block import traced  # noqa: F401  (a fixture: compile with the aot_eager backend)
from trainer_helpers import random_row

STEPS = 3


@pytest.fixture
def dims():
    d = init_parallel("cpu")
    yield d
    close_parallel()


def step_batches(step: int, device: torch.device) -> list[MicroBatch]:
    """Two micro-batches (gradient accumulation), the same at every call for a step."""
    gen = torch.Generator().manual_seed(step)
    return [MicroBatch.from_row(random_row(gen, [(3, 5), (2, 9)]), device), MicroBatch.from_row(random_row(gen, [(4, 7)]), device)]


class Trainer:
    """A policy, AdamW and a schedule on one path."""

    def __init__(self, model: Path, dims, fsdp: bool, dtype: str, checkpointing: str = "selective", compile: str = "auto",
                 reshard: bool = True):
        parallel = ParallelConfig(fsdp_at_one_rank=fsdp, activation_checkpoint=ActivationCheckpointConfig(mode=checkpointing),
                                  reshard_after_forward=reshard)
        self.dims = dims
        self.policy, _ = build_policy(ModelConfig(name=str(model), dtype=dtype), parallel, dims, chunk_size=4,
                                      kernels=KernelsConfig(compile=compile))
        self.optimizer = build_optimizer(self.policy, AdamWConfig(lr=1e-2))
        self.scheduler = build_scheduler(self.optimizer, ConstantSchedule(), STEPS)
        self.objective = rl_objective(build_loss(AIPOLoss()))

    def step(self, step: int) -> tuple[float, float]:
        mbs = step_batches(step, self.dims.device)
        result = train_step(self.policy, self.optimizer, self.scheduler, mbs, self.objective, count_loss_tokens(mbs, self.dims),
                            0.5, self.dims)
        assert not result.skipped
        return result.loss, result.grad_norm

    def weights(self) -> dict[str, torch.Tensor]:
        return gather_full_state(self.policy, torch.float32, keep=True)


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("model,dtype,checkpointing,reshard", [
    ("tiny_model", "bfloat16", "selective", True), ("tiny_model", "bfloat16", "full", True),
    ("tiny_model", "bfloat16", "off", True), ("tiny_model", "bfloat16", "selective", False),
    ("tiny_model", "float32", "selective", True), ("tiny_glm_model", "bfloat16", "selective", True)])
def test_one_rank_trains_bit_for_bit_like_fsdp(request, dims, model, dtype, checkpointing, reshard):
    """`off` with `reshard`: backward reads weights autograd saved in forward, freed after the block's forward
    and rounded again before its backward. `tiny_glm_model`: a mixture of experts whose router has a score
    correction bias (a parameter without gradient, cast like the others by FSDP, updated after each step)."""
    model = request.getfixturevalue(model)
    fsdp = Trainer(model, dims, fsdp=True, dtype=dtype, checkpointing=checkpointing, reshard=reshard)
    plain = Trainer(model, dims, fsdp=False, dtype=dtype, checkpointing=checkpointing, reshard=reshard)
    assert all(isinstance(p, DTensor) for p in fsdp.policy.parameters())
    assert not any(isinstance(p, DTensor) for p in plain.policy.parameters())
    lm = plain.policy.lm
    if lm.args.tie_word_embeddings:
        assert lm.lm_head.weight is lm.model.embed_tokens.weight  # the tied embedding stays one parameter
    assert (plain.policy.one_rank is not None) == (dtype == "bfloat16")
    start = plain.weights()
    for step in range(STEPS):
        assert plain.step(step) == fsdp.step(step), step
    after = plain.weights()
    assert_same_weights(after, fsdp.weights())
    trained = [name for name, p in plain.policy.hf_named_parameters() if p.requires_grad]
    assert all(not torch.equal(after[k], start[k]) for k in trained)  # every trained parameter moved
    assert all(p.dtype == torch.float32 for p in plain.policy.parameters())  # the masters are back after the step
    mbs = step_batches(STEPS, dims.device)
    assert evaluate(plain.policy, mbs, plain.objective, dims) == evaluate(fsdp.policy, mbs, fsdp.objective, dims)
    assert all(p.dtype == torch.float32 for p in plain.policy.parameters())


@pytest.mark.slow
def test_compiled_one_rank_trains_bit_for_bit_like_fsdp_without_recompiling(tiny_model, dims, traced):
    """The compiled halves take the compute copies (plain bf16 parameters, their storage freed and made again
    every pass) where they took FSDP's gathered weights: the same graphs, the same numbers, and no recompile."""
    from torch._dynamo.utils import counters

    fsdp = Trainer(tiny_model, dims, fsdp=True, dtype="bfloat16", compile="on")
    plain = Trainer(tiny_model, dims, fsdp=False, dtype="bfloat16", compile="on")
    assert plain.step(0) == fsdp.step(0)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0
    for step in range(1, STEPS):
        assert plain.step(step) == fsdp.step(step), step
    assert counters["stats"]["unique_graphs"] == graphs
    assert_same_weights(plain.weights(), fsdp.weights())


def test_compute_copies_follow_every_change_of_the_masters(tiny_model, dims):
    """Fused AdamW (CUDA's optimizer) changes the masters without bumping their version counters: forward must
    still compute with the new weights, never with stale copies."""
    plain = Trainer(tiny_model, dims, fsdp=False, dtype="bfloat16")
    mbs = step_batches(0, dims.device)
    before = evaluate(plain.policy, mbs, plain.objective, dims)
    params = list(plain.policy.parameters())
    for p in params:
        p.grad = torch.ones_like(p)
    torch.optim.AdamW(params, lr=1e-1, fused=True).step()
    fresh = Trainer(tiny_model, dims, fsdp=False, dtype="bfloat16")
    with torch.no_grad():
        for mine, theirs in zip(params, fresh.policy.parameters()):
            theirs.copy_(mine)
    after = evaluate(plain.policy, mbs, plain.objective, dims)
    assert after != before and after == evaluate(fresh.policy, mbs, fresh.objective, dims)


def test_a_dropped_one_rank_model_frees_its_masters(tiny_model, dims):
    """A process that builds several trainers (a benchmark's shapes, the tests) gets each one's memory back: the
    gradient hooks live where the garbage collector does not look, so they must not hold the model alive (they did:
    every 0.6B trainer built on the H200 kept its 2.2 GiB of fp32 masters)."""
    import gc
    import weakref

    plain = Trainer(tiny_model, dims, fsdp=False, dtype="bfloat16")
    plain.step(0)
    masters = [weakref.ref(p) for p in plain.policy.parameters()]
    assert plain.policy.one_rank is not None and all(m().dtype == torch.float32 for m in masters)
    del plain
    gc.collect()
    assert all(m() is None for m in masters)


@pytest.mark.parametrize("save_fsdp", [False, True])
def test_a_checkpoint_resumes_on_the_other_path(tiny_model, dims, tmp_path, save_fsdp):
    dtype = "bfloat16"
    reference = Trainer(tiny_model, dims, fsdp=False, dtype=dtype)
    expected = [reference.step(step) for step in range(STEPS)]

    saver = Trainer(tiny_model, dims, fsdp=save_fsdp, dtype=dtype)
    assert saver.step(0) == expected[0]
    folder = save_checkpoint(tmp_path, 1, saver.policy, saver.optimizer, saver.scheduler, {}, dims)
    loader = Trainer(tiny_model, dims, fsdp=not save_fsdp, dtype=dtype)
    assert load_checkpoint(folder, loader.policy, loader.optimizer, loader.scheduler, dims).step == 1
    assert [loader.step(step) for step in range(1, STEPS)] == expected[1:]
    assert_same_weights(loader.weights(), reference.weights())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_compiled_one_rank_trains_like_fsdp(tiny_model):
    """bf16, compiled halves, fused AdamW. The first forward is the same computation bit for bit; after it,
    attention's backward kernels may add in any order (atomics), so the runs agree to bf16 noise only."""
    dims = init_parallel("cuda")
    try:
        fsdp = Trainer(tiny_model, dims, fsdp=True, dtype="bfloat16", compile="on")
        plain = Trainer(tiny_model, dims, fsdp=False, dtype="bfloat16", compile="on")
        first_fsdp, first_plain = fsdp.step(0), plain.step(0)
        assert first_plain[0] == first_fsdp[0]
        assert first_plain[1] == pytest.approx(first_fsdp[1], rel=1e-3)
        for step in range(1, STEPS):
            assert plain.step(step) == pytest.approx(fsdp.step(step), rel=1e-2, abs=1e-2), step
        a, b = plain.weights(), fsdp.weights()
        # Adam moves an element whose gradient is only noise by up to lr (1e-2) a step, either way.
        assert max((a[k] - b[k]).abs().max().item() for k in a) <= 2 * 1e-2 * STEPS
        assert all(p.dtype == torch.float32 and p.device.type == "cuda" for p in plain.policy.parameters())
    finally:
        close_parallel()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("fsdp", [False, True], ids=["one-rank", "fsdp"])
def test_routers_that_compute_in_fp32_stay_fp32_under_bf16_mixed_precision(tiny_glm_model, dims, lora, fsdp):
    """GLM's router weight and score bias are fp32 in every load (`moe.fp32_routers`), as the engine holds them: the
    trainer's bf16 mixed precision (the one-rank path's copies, FSDP's units) and its frozen LoRA base keep them so.
    Rounded to bf16, they chose other experts than the engine for tokens near a tie (exact mode's parity in bf16)."""
    lora_config = LoraConfig(enabled=True, rank=4, alpha=8.0, target_modules=["o_proj"]) if lora else LoraConfig()
    policy, _ = build_policy(ModelConfig(name=str(tiny_glm_model), dtype="bfloat16"), ParallelConfig(fsdp_at_one_rank=fsdp),
                             dims, chunk_size=4, lora=lora_config)
    seen = []
    for router in fp32_routers(policy):  # after FSDP's own hook: the gathered parameters
        router.register_forward_pre_hook(lambda module, args: seen.append(
            {name: param.detach().clone() for name, param in module.named_parameters()}))
    mb = step_batches(0, dims.device)[0]
    with torch.no_grad():
        policy(mb.input_ids, mb.position_ids, mb.temperatures, mb.loss_mask)
    held = [dict(router.named_parameters()) for router in fp32_routers(load_causal_lm(str(tiny_glm_model), "cpu", "bfloat16"))]
    assert len(seen) == len(held) > 0
    for got, want in zip(seen, held):
        assert got.keys() == want.keys()
        for name in got:
            assert got[name].dtype == torch.float32 and torch.equal(got[name], want[name]), name


def test_fp32_routers_are_published_in_fp32(tiny_glm_model, dims):
    """After a step in bf16, a policy update published in bf16 holds the routers as the trainer computes with them
    (their fp32 masters, which the engine holds in fp32); every other weight in bf16. The broadcast announces the
    same dtypes."""
    trainer = Trainer(tiny_glm_model, dims, fsdp=False, dtype="bfloat16")
    trainer.step(0)
    policy = trainer.policy
    routers = fp32_router_parameters(policy)
    state = gather_full_state(policy, torch.bfloat16, keep=True)
    announced = announced_state(policy, torch.bfloat16)
    names = set()
    for name, param in policy.published_parameters():
        want = torch.float32 if id(param) in routers else torch.bfloat16
        assert state[name].dtype == announced[name].dtype == want, name
        if want == torch.float32:
            names.add(name)
            assert torch.equal(state[name], param.detach()), name
    assert names and all(".mlp.gate." in name for name in names)
