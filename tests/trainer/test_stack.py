"""All blocks as one compiled graph (`tandem.trainer.stack`) train bit for bit like the blocks compiled apart.

The `traced` fixture compiles with `aot_eager` (Dynamo and AOTAutograd as on a GPU, eager kernels), so both paths
run the same kernels on the same numbers: any difference is a defect of the stack (a weight read at the wrong
time, a stale compute copy, a recompute that saved something else). bf16 on the CPU exercises the one-rank
path's compute copies, which the stack rounds all at once instead of block by block.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from tandem.config.base import ModelConfig
from tandem.config.trainer import ActivationCheckpointConfig, AdamWConfig, AIPOLoss, ConstantSchedule, KernelsConfig, ParallelConfig
from tandem.models.decoder import DecoderLM
from tandem.trainer.micro_batch import MicroBatch
from tandem.trainer.loss import build_loss
from tandem.trainer.model import build_policy, gather_full_state
from tandem.trainer.optim import build_optimizer, build_scheduler
from tandem.trainer.parallel.dims import close_parallel, init_parallel
from tandem.trainer.rl.train import rl_objective
from tandem.trainer.step import count_loss_tokens, evaluate, train_step

from test_block import traced  # noqa: F401  (a fixture: compile with the aot_eager backend)
from test_one_rank import assert_same_weights, dims  # noqa: F401  (dims: a fixture, the CPU process group)
from trainer_helpers import random_row

ONE_DOCUMENT_ROWS = [[(3, 9)], [(5, 14)], [(4, 6)]]
"""(prompt, completion) of each step's row: three row lengths, one document each."""
PACKED_ROWS = [[(3, 5), (2, 9)], [(4, 7), (3, 3), (2, 2)], [(6, 6), (1, 4)]]


@pytest.fixture
def one_by_one_calls(monkeypatch) -> list[int]:
    """Counts the passes that ran the blocks one by one (the stack binds `DecoderLM.run_layers` when applied)."""
    calls = []
    original = DecoderLM.run_layers

    def spy(self, *args):
        calls.append(1)
        return original(self, *args)
    monkeypatch.setattr(DecoderLM, "run_layers", spy)
    return calls


class Trainer:
    def __init__(self, model: Path, dims, stack: bool, dtype: str = "bfloat16", checkpointing: str = "selective"):
        parallel = ParallelConfig(fsdp_at_one_rank=False, activation_checkpoint=ActivationCheckpointConfig(mode=checkpointing))
        self.dims = dims
        self.policy, _ = build_policy(ModelConfig(name=str(model), dtype=dtype), parallel, dims, chunk_size=4,
                                      kernels=KernelsConfig(compile="on", compile_stack=stack))
        self.optimizer = build_optimizer(self.policy, AdamWConfig(lr=1e-2))
        self.scheduler = build_scheduler(self.optimizer, ConstantSchedule(), len(ONE_DOCUMENT_ROWS))
        self.objective = rl_objective(build_loss(AIPOLoss()))

    def step(self, rows: list[tuple[int, int]], step: int) -> tuple[float, float]:
        mbs = batches(rows, step, self.dims.device)
        result = train_step(self.policy, self.optimizer, self.scheduler, mbs, self.objective, count_loss_tokens(mbs, self.dims),
                            0.5, self.dims)
        assert not result.skipped
        return result.loss, result.grad_norm

    def weights(self) -> dict[str, torch.Tensor]:
        return gather_full_state(self.policy, torch.float32, keep=True)


def batches(rows: list[tuple[int, int]], step: int, device: torch.device) -> list[MicroBatch]:
    gen = torch.Generator().manual_seed(step)
    return [MicroBatch.from_row(random_row(gen, rows), device)]


def largest_weight_gap(a: Trainer, b: Trainer) -> float:
    wa, wb = a.weights(), b.weights()
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", ["selective", "off"])
def test_the_stack_trains_bit_for_bit_like_blocks_compiled_apart_and_compiles_once(tiny_model, dims, traced, one_by_one_calls,
                                                                                   checkpointing):
    """bf16, three steps of three row lengths: one graph for all of them (the row length is dynamic)."""
    stacked = Trainer(tiny_model, dims, stack=True, checkpointing=checkpointing)
    assert stacked.policy.compiled_stack
    losses = [stacked.step(ONE_DOCUMENT_ROWS[0], 0)]
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0
    losses += [stacked.step(rows, step) for step, rows in enumerate(ONE_DOCUMENT_ROWS[1:], start=1)]
    assert counters["stats"]["unique_graphs"] == graphs  # no recompile for other row lengths
    assert not one_by_one_calls  # every pass ran the stack's graph
    apart = Trainer(tiny_model, dims, stack=False, checkpointing=checkpointing)
    assert not apart.policy.compiled_stack
    assert [apart.step(rows, step) for step, rows in enumerate(ONE_DOCUMENT_ROWS)] == losses
    assert_same_weights(stacked.weights(), apart.weights())
    assert_no_compute_copy_held(stacked)  # after backward
    mbs = batches(ONE_DOCUMENT_ROWS[0], 9, dims.device)
    expected = evaluate(apart.policy, mbs, apart.objective, dims)
    one_by_one_calls.clear()  # the blocks-apart trainer's passes counted too
    assert evaluate(stacked.policy, mbs, stacked.objective, dims) == expected
    assert len(one_by_one_calls) == 1  # without gradients: no second whole-stack graph for one evaluation
    assert_no_compute_copy_held(stacked)  # after a forward without gradients


def assert_no_compute_copy_held(trainer: Trainer) -> None:
    """The stack rounds every block's bf16 copy at the root's forward: after a backward (their gradients folded) and
    after a forward without gradients (nothing else frees them) none is left allocated, and the masters are back."""
    one_rank = trainer.policy.one_rank
    assert one_rank is not None and not one_rank.per_block
    assert all(copy is master or copy.untyped_storage().size() == 0 for copy, master in zip(one_rank.compute, one_rank.masters))
    assert all(p.dtype == torch.float32 for p in trainer.policy.parameters())


def test_in_fp32_the_stack_computes_the_same_forward_and_gradients_to_rounding(tiny_model, dims, traced):
    """fp32 (no compute copies): the forward is the same bit for bit; the first block's gradients differ from the
    blocks-apart path's in their last bits (1e-6 at most here; every later block's are equal), not traced further
    (the residual stream's gradient is summed across compiled regions by autograd in one case, inside one graph in
    the other). Trained weights agree to that rounding."""
    stacked, apart = Trainer(tiny_model, dims, stack=True, dtype="float32"), Trainer(tiny_model, dims, stack=False, dtype="float32")
    first = stacked.step(ONE_DOCUMENT_ROWS[0], 0)
    assert apart.step(ONE_DOCUMENT_ROWS[0], 0)[0] == first[0]
    for step, rows in enumerate(ONE_DOCUMENT_ROWS[1:], start=1):
        assert stacked.step(rows, step) == pytest.approx(apart.step(rows, step), rel=1e-5), step
    assert largest_weight_gap(stacked, apart) < 1e-4


def test_packed_rows_on_a_cpu_run_the_blocks_one_by_one_with_the_same_numbers(tiny_model, dims, traced, one_by_one_calls):
    """On a CPU, attention over packed rows loops over the documents' lengths: one graph per packing would be
    compiled, so those batches take the blocks apart (rounded by the stack's one-rank copies all the same)."""
    stacked = Trainer(tiny_model, dims, stack=True)
    losses = [stacked.step(rows, step) for step, rows in enumerate(PACKED_ROWS)]
    assert len(one_by_one_calls) == len(PACKED_ROWS)
    apart = Trainer(tiny_model, dims, stack=False)
    assert [apart.step(rows, step) for step, rows in enumerate(PACKED_ROWS)] == losses
    assert_same_weights(stacked.weights(), apart.weights())


def test_a_mixture_of_experts_keeps_its_blocks_apart(tiny_moe_model, dims, traced):
    """Routing sets the experts' shapes: no one graph for every batch, so the stack does not apply."""
    assert not Trainer(tiny_moe_model, dims, stack=True).policy.compiled_stack


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rows", [ONE_DOCUMENT_ROWS, PACKED_ROWS], ids=["one-document", "packed"])
def test_on_cuda_the_stack_trains_like_blocks_compiled_apart(tiny_model, rows):
    """Inductor, bf16, cuDNN attention for one document and variable-length FlashAttention for packed rows, both
    inside the graph. Inductor may fuse across the blocks' boundaries, and attention's backward adds in any order
    (atomics), so the runs agree to bf16 noise, not bit for bit."""
    dims = init_parallel("cuda")
    try:
        stacked, apart = Trainer(tiny_model, dims, stack=True), Trainer(tiny_model, dims, stack=False)
        assert stacked.policy.compiled_stack
        for step, row in enumerate(rows):
            assert stacked.step(row, step) == pytest.approx(apart.step(row, step), rel=1e-2, abs=1e-2), step
        assert largest_weight_gap(stacked, apart) <= 2 * 1e-2 * len(rows)
    finally:
        close_parallel()
