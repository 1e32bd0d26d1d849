"""Router replay end to end on CPU: the engine's experts per sampled token, through the orchestrator's
samples, packing and the msgpack wire format, replayed by the trainer's forward."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tandem.config.base import ModelConfig
from tandem.config.inference import EngineConfig
from tandem.config.trainer import ParallelConfig
from tandem.inference.engine.sampling_params import SamplingParams
from tandem.inference.engine.setup import build_engine
from tandem.models.moe import TopKRouter
from tandem.orchestrator.packing import pack_step
from tandem.orchestrator.samples import Turn, build_samples
from tandem.trainer.micro_batch import MicroBatch
from tandem.trainer.data import BatchError, check_step_batch
from tandem.trainer.model import build_policy
from tandem.trainer.parallel.dims import close_parallel, init_parallel
from tandem.trainer.step import maybe_replayed_routing
from tandem.transport.types import TrainingBatch, decode_batch, encode_batch


@pytest.fixture
def dims():
    d = init_parallel("cpu")
    yield d
    close_parallel()


@pytest.fixture(scope="module")
def sampled_turns(tiny_moe_model) -> list[list[Turn]]:
    """Two-turn rollouts from the CPU engine, with the experts that sampled each token."""
    return sample_turns(tiny_moe_model)


def sample_turns(model: Path, exact: bool = False) -> list[list[Turn]]:
    engine = build_engine(ModelConfig(name=str(model)), EngineConfig(device="cpu", num_blocks=64, max_model_len=256),
                          seed=0, exact=exact)
    rng = random.Random(0)
    rollouts = []
    for i in range(3):
        turns: list[Turn] = []
        prompt = [rng.randrange(256) for _ in range(rng.randint(2, 30))]
        for _ in range(2):
            engine.add_request(f"{i}-{len(turns)}", prompt, SamplingParams(max_tokens=10, seed=i, ignore_eos=True,
                                                                          return_routed_experts=True), incremental=False)
            out = []
            while engine.has_unfinished:
                out.extend(engine.step())
            turns.append(Turn(prompt, out[0].token_ids, out[0].logprobs, 0, 1.0, out[0].routed_experts))
            prompt = prompt + out[0].token_ids + [rng.randrange(256) for _ in range(5)]  # an environment reply
        rollouts.append(turns)
    return rollouts


def rows_on_the_wire(rollouts: list[list[Turn]]):
    samples = [s for turns in rollouts for s in build_samples(turns)]
    batches, _ = pack_step(1, samples, seq_len=256, num_ranks=1, pad_token_id=0)
    return decode_batch(encode_batch(batches[0])).rows


def trainer_forward(policy, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's logprobs of the micro-batch and the experts its MoE layers used [T, L, k]."""
    used = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: used.append(out[1]))
             for m in policy.lm.modules() if isinstance(m, TopKRouter)]
    with maybe_replayed_routing(policy, mb):
        out = policy(mb.input_ids, mb.position_ids, mb.temperatures, mb.loss_mask)
    for hook in hooks:
        hook.remove()
    return out.logprobs, torch.stack(used, 1)


def test_replayed_trainer_logprobs_equal_the_engines_with_its_experts(tiny_moe_model, sampled_turns, dims):
    policy, _ = build_policy(ModelConfig(name=str(tiny_moe_model)), ParallelConfig(), dims, chunk_size=64)
    rows = rows_on_the_wire(sampled_turns)
    assert len(rows) == 1 and len(rows[0].routed_experts) == len(rows[0].input_ids)
    mb = MicroBatch.from_row(rows[0], dims.device, router_replay=True)
    logprobs, used = trainer_forward(policy, mb)
    mask = mb.loss_mask[0]
    assert int(mask.sum()) == 3 * 2 * 10
    torch.testing.assert_close(logprobs[0][mask], mb.inference_logprobs[0][mask], atol=1e-5, rtol=0)
    replayed = mb.routed_experts[:, 0, 0] >= 0
    assert torch.equal(replayed[:-1], mask[1:])  # exactly the positions that sampled a loss token
    assert torch.equal(used[replayed], mb.routed_experts[replayed])

    # Other experts at those positions give other logprobs: the replay is what the forward used.
    shifted = torch.where(mb.routed_experts >= 0, (mb.routed_experts + 1) % 8, -1)
    other, _ = trainer_forward(policy, MicroBatch(**{**vars(mb), "routed_experts": shifted}))
    assert (other[0][mask] - logprobs[0][mask]).abs().max() > 1e-2


def test_an_exact_engine_reports_the_experts_each_token_took(tiny_moe_model, dims):
    """Exact mode runs the MoE once per token (`tandem.models.exact`): each token's experts are still reported at
    its own row, those the trainer's own routing picks for it (a prompt's last token, in a prefill of several, too)."""
    row = rows_on_the_wire(sample_turns(tiny_moe_model, exact=True))[0]
    reported = MicroBatch.from_row(row, dims.device, router_replay=True).routed_experts
    policy, _ = build_policy(ModelConfig(name=str(tiny_moe_model)), ParallelConfig(), dims, chunk_size=64)
    _, used = trainer_forward(policy, MicroBatch.from_row(row, dims.device))
    sampled = reported[:, 0, 0] >= 0
    assert int(sampled.sum()) == 3 * 2 * 10
    assert torch.equal(used[sampled].sort(-1).values, reported[sampled].long().sort(-1).values)


def test_router_replay_without_routed_experts_is_a_clear_error(sampled_turns, dims):
    turns = [[Turn(t.prompt_ids, t.completion_ids, t.logprobs, t.version, t.temperature) for t in r] for r in sampled_turns]
    batch = TrainingBatch(step=1, rank=0, rows=rows_on_the_wire(turns), num_loss_tokens=60)
    assert batch.rows[0].routed_experts == []
    check_step_batch(batch, 256, 256, "step 1", dims)  # fine without replay
    assert MicroBatch.from_row(batch.rows[0], dims.device).routed_experts is None
    with pytest.raises(BatchError, match="orchestrator.sampling.return_routed_experts"):
        check_step_batch(batch, 256, 256, "step 1", dims, router_replay=True)


def test_routed_experts_not_aligned_with_the_tokens_are_refused(sampled_turns, dims):
    row = rows_on_the_wire(sampled_turns)[0]
    batch = TrainingBatch(step=1, rank=0, rows=[row], num_loss_tokens=60)
    check_step_batch(batch, 256, 256, "step 1", dims, router_replay=True)
    row.routed_experts.pop()
    with pytest.raises(BatchError, match="routed_experts"):
        check_step_batch(batch, 256, 256, "step 1", dims, router_replay=True)
