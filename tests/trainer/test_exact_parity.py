"""`[run] exact = true` on the CPU in fp32: the engine's logprobs equal the trainer's bitwise (`torch.equal`),
whatever the batches the engine formed (prefill chunks beside decodes, other sequences), single- and
multi-turn, through the orchestrator's samples, packing and the wire format."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.config.base import ModelConfig
from tandem.config.inference import EngineConfig
from tandem.config.trainer import ParallelConfig
from tandem.inference.engine.sampling_params import SamplingParams
from tandem.inference.engine.setup import build_engine
from tandem.orchestrator.packing import pack_step
from tandem.orchestrator.samples import Turn, build_samples
from tandem.trainer.batch import MicroBatch
from tandem.trainer.model import build_policy
from tandem.trainer.parallel.dims import close_parallel, init_parallel
from tandem.transport.types import decode_batch, encode_batch

from trainer_helpers import metrics, run_trainer

NUM_TURNS = {0: 1, 1: 2, 2: 1, 3: 2}
"""Conversation -> model turns (1: single-turn, 2: multi-turn)."""


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]
"""fp32 on the CPU; bf16 (`model.dtype = auto`) on CUDA, where exact mode is not measured yet: this is its test."""


@pytest.fixture
def dims(request):
    d = init_parallel(getattr(request, "param", "cpu"))
    yield d
    close_parallel()


def sample_conversations(model_folder, max_num_batched_tokens: int, staggered: bool, device: str = "cpu") -> dict[int, list[Turn]]:
    """Conversations from an exact engine; `staggered`: each new turn joins while others decode (mixed batches),
    else each request runs alone."""
    engine = build_engine(ModelConfig(name=str(model_folder)), EngineConfig(
        device=device, num_blocks=128, max_model_len=256, max_num_batched_tokens=max_num_batched_tokens), seed=0, exact=True)
    rng = random.Random(0)
    prompts = {c: [rng.randrange(256) for _ in range(rng.randint(3, 40))] for c in NUM_TURNS}
    turns: dict[int, list[Turn]] = {c: [] for c in NUM_TURNS}

    def add(c: int) -> None:
        params = SamplingParams(max_tokens=6 + c, seed=c * 10 + len(turns[c]), temperature=0.7, ignore_eos=True)
        engine.add_request(f"{c}-{len(turns[c])}", prompts[c], params, incremental=False)

    waiting = list(NUM_TURNS)
    while waiting or engine.has_unfinished:
        if waiting and (staggered or not engine.has_unfinished):
            add(waiting.pop(0))
        for out in engine.step():
            c = int(out.request_id.split("-")[0])
            turns[c].append(Turn(prompts[c], out.token_ids, out.logprobs, 0, 0.7))
            if len(turns[c]) < NUM_TURNS[c]:  # an environment reply, then the next model turn
                prompts[c] = prompts[c] + out.token_ids + [rng.randrange(256) for _ in range(4)]
                waiting.append(c)
    return turns


@pytest.mark.parametrize("model", ["tiny_model", "tiny_moe_model"])
@pytest.mark.parametrize("dims", DEVICES, indirect=True)
def test_engine_logprobs_equal_the_trainers_bitwise(model, dims, request):
    tiny_model = request.getfixturevalue(model)  # dense, and a mixture of experts (routing token by token too)
    device = dims.device.type
    mixed = sample_conversations(tiny_model, max_num_batched_tokens=16, staggered=True, device=device)
    alone = sample_conversations(tiny_model, max_num_batched_tokens=512, staggered=False, device=device)
    # Batch-invariant engine: the same seeds draw the same tokens with the same logprobs in any batch.
    for c in NUM_TURNS:
        assert [t.completion_ids for t in mixed[c]] == [t.completion_ids for t in alone[c]]
        assert [t.logprobs for t in mixed[c]] == [t.logprobs for t in alone[c]]

    samples = [s for c in NUM_TURNS for s in build_samples(mixed[c])]
    assert len(samples) == len(NUM_TURNS)  # multi-turn conversations stay one sample each
    batches, _ = pack_step(1, samples, seq_len=256, num_ranks=1, pad_token_id=0)
    rows = decode_batch(encode_batch(batches[0])).rows
    assert any(sum(p == 0 for p in row.position_ids) > 1 for row in rows)  # packed rows: several documents
    policy, _ = build_policy(ModelConfig(name=str(tiny_model)), ParallelConfig(), dims, chunk_size=64, exact=True)
    num_loss_tokens = 0
    with torch.no_grad():
        for row in rows:
            mb = MicroBatch.from_row(row, dims.device)
            out = policy(mb.input_ids, mb.position_ids, mb.temperatures, mb.loss_mask)
            mask = mb.loss_mask[0]
            assert torch.equal(out.logprobs[0][mask], mb.inference_logprobs[0][mask])
            num_loss_tokens += int(mask.sum())
    assert num_loss_tokens == sum(6 + c for c in NUM_TURNS for _ in range(NUM_TURNS[c]))


def test_without_exact_the_paths_differ(tiny_model, dims):
    """The check above can fail: the default kernels (SDPA on packed rows, batched matmuls) round otherwise."""
    turns = sample_conversations(tiny_model, max_num_batched_tokens=16, staggered=True)
    batches, _ = pack_step(1, [s for c in NUM_TURNS for s in build_samples(turns[c])], seq_len=256, num_ranks=1, pad_token_id=0)
    policy, _ = build_policy(ModelConfig(name=str(tiny_model)), ParallelConfig(), dims, chunk_size=64)
    differ = []
    with torch.no_grad():
        for row in batches[0].rows:
            mb = MicroBatch.from_row(row, dims.device)
            out = policy(mb.input_ids, mb.position_ids, mb.temperatures, mb.loss_mask)
            mask = mb.loss_mask[0]
            differ.append(not torch.equal(out.logprobs[0][mask], mb.inference_logprobs[0][mask]))
            torch.testing.assert_close(out.logprobs[0][mask], mb.inference_logprobs[0][mask], atol=1e-4, rtol=0)
    assert any(differ)


def test_exact_refuses_a_transformers_model(llama_model, dims):
    with pytest.raises(ValueError, match="falls back to transformers"):
        build_policy(ModelConfig(name=str(llama_model)), ParallelConfig(), dims, chunk_size=64, exact=True)
    with pytest.raises(ValueError, match="falls back to transformers"):
        build_engine(ModelConfig(name=str(llama_model)), EngineConfig(device="cpu", num_blocks=8, max_model_len=64), seed=0,
                     exact=True)


def test_the_trainer_trains_in_exact_mode(tiny_model, tmp_path):
    """Backward runs through the token-by-token blocks and the row-wise head (whole-block recompute)."""
    assert run_trainer("--model.name", str(tiny_model), "--run.exact", "true", "--data.fake", "--max-steps", "2",
                       "--output-dir", str(tmp_path), "--seq-len", "16", "--optim.lr", "1e-3") == 0
    records = metrics(tmp_path)
    assert [r["skipped"] for r in records] == [0, 0] and records[1]["loss"] != records[0]["loss"]
    assert all(r["grad_norm"] > 0 for r in records)
