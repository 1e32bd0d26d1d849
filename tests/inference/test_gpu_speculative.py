"""Speculative decoding on CUDA: verifying steps replay CUDA graphs of k + 1 tokens a sequence, n-gram steps that
do not draft stay overlapped, and the tokens' logprobs are still the policy's teacher-forced ones."""

import random

import pytest
import torch
from inference_helpers import check_teacher_forced

from tandem.config.base import ModelConfig
from tandem.config.inference import EngineConfig, SpeculativeConfig
from tandem.inference.engine.sampling_params import SamplingParams
from tandem.inference.engine.setup import build_engine
from tandem.models.loading import load_causal_lm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def count_replays(graphs) -> list[int]:
    """Wrap `graphs.replay` to count its calls; returns the one-element counter."""
    calls = [0]
    replay = graphs.replay

    def counted(*args, **kwargs):
        calls[0] += 1
        return replay(*args, **kwargs)

    graphs.replay = counted
    return calls


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "read-each-step"])
def test_verifying_graphs_give_the_policys_logprobs(tiny_dir, overlap):
    """fp32: prompts that repeat themselves (drafts accepted and rejected), seeded and unseeded, greedy and
    sampled, some sequences prefilling while others verify (those steps run eager); logprobs match a
    teacher-forced pass, and verifying steps replayed their graphs."""
    engine = build_engine(ModelConfig(name=str(tiny_dir), dtype="float32"),
                          EngineConfig(device="cuda", max_num_seqs=24, max_model_len=256, max_num_batched_tokens=96,
                                       overlap_steps=overlap,
                                       speculative=SpeculativeConfig(method="ngram", num_tokens=4,
                                                                     min_expected_tokens=0)), seed=0)
    assert engine.runner.verify_graphs is not None and engine.overlap == overlap
    replays = count_replays(engine.runner.verify_graphs)
    model = load_causal_lm(str(tiny_dir))
    rng = random.Random(0)
    requests = {}
    for i in range(12):
        piece = [rng.randrange(256) for _ in range(rng.randint(3, 12))]
        prompt = piece * rng.randint(2, 6)
        params = SamplingParams(max_tokens=40, temperature=[0.0, 0.7, 1.0][i % 3], seed=i if i % 2 else None,
                                ignore_eos=True)
        requests[str(i)] = (prompt, params)
        engine.add_request(str(i), prompt, params, n=2, incremental=False)
    outputs = check_teacher_forced(engine, model, requests, 24)
    assert all(len(out.token_ids) == 40 for out in outputs)
    stats = engine.stats()
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert replays[0] > 0


def test_greedy_tokens_are_the_same_with_speculation_on_or_off(tiny_dir):
    """fp32 greedy decoding of repeating prompts through both kinds of graphs gives the same tokens as without
    speculation (where the top two logits are further apart than fp32 rounding, as here)."""
    rng = random.Random(1)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(4, 10))] * 4 for _ in range(16)]
    results = []
    for spec in (SpeculativeConfig(), SpeculativeConfig(method="ngram", min_expected_tokens=0)):
        engine = build_engine(ModelConfig(name=str(tiny_dir), dtype="float32"),
                              EngineConfig(device="cuda", max_num_seqs=16, max_model_len=256, speculative=spec), seed=0)
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True),
                               incremental=False)
        outputs = {}
        while engine.has_unfinished:
            for out in engine.step():
                outputs[out.request_id] = out.token_ids
        results.append((outputs, engine.stats()))
    (plain, _), (speculated, stats) = results
    assert stats.num_accepted_tokens > 0
    assert speculated == plain
