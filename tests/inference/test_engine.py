"""The engine without HTTP: logprob parity, prefix sharing, stops, weight updates."""

import random

import pytest
import torch
from inference_helpers import teacher_forced_logprobs

from tandem.config.base import ModelConfig
from tandem.config.inference import EngineConfig
from tandem.inference.engine.sampling_params import SamplingParams
from tandem.inference.engine.setup import build_engine
from tandem.models.weights import load_state_dict


def engine_for(model_dir, **settings):
    config = {"device": "cpu", "num_blocks": 256, "block_size": 16, "max_model_len": 512, "max_num_batched_tokens": 512, **settings}
    return build_engine(ModelConfig(name=str(model_dir)), EngineConfig(**config), seed=0)


def run(engine) -> dict[tuple[str, int], dict]:
    """Step until idle; per (request, index): token ids, logprobs, text, finish reason."""
    results: dict[tuple[str, int], dict] = {}
    while engine.has_unfinished:
        for out in engine.step():
            r = results.setdefault((out.request_id, out.index), {"ids": [], "logprobs": [], "text": "", "finish": None})
            r["ids"] += out.token_ids
            r["logprobs"] += out.logprobs
            r["text"] += out.text
            r["finish"] = out.finish_reason
    return results


@pytest.mark.parametrize("settings", [
    {},
    # A cache of 12 blocks and a 40-token budget: chunked prefills and preemptions all along.
    {"num_blocks": 12, "max_num_batched_tokens": 40, "max_model_len": 160},
], ids=["roomy", "memory-starved"])
def test_logprobs_match_a_teacher_forced_pass(tiny_dir, tiny_model, settings):
    engine = engine_for(tiny_dir, **settings)
    rng = random.Random(0)
    requests = {}
    for i in range(12):
        prompt = [rng.randrange(256) for _ in range(rng.randint(1, 100))]
        params = SamplingParams(max_tokens=24, temperature=[0.0, 0.7, 1.0, 1.5][i % 4], top_k=[-1, 20][i % 2], seed=i, ignore_eos=True)
        requests[str(i)] = (prompt, params)
        engine.add_request(str(i), prompt, params, n=2)
    results = run(engine)
    assert len(results) == 24
    for (rid, _), r in results.items():
        prompt, params = requests[rid]
        expected = teacher_forced_logprobs(tiny_model, prompt, r["ids"], params.temperature)
        assert len(r["ids"]) == 24
        assert torch.allclose(torch.tensor(r["logprobs"]), expected, atol=1e-5, rtol=0)
    if settings:
        assert engine.scheduler.num_preemptions > 0


def test_n_samples_share_the_prompt_prefill(tiny_dir):
    engine = engine_for(tiny_dir)
    computed = []
    run_batch = engine.runner.run
    engine.runner.run = lambda batch: (computed.append(batch.num_tokens), run_batch(batch))[1]
    engine.add_request("r", list(range(100)), SamplingParams(max_tokens=1), n=4)
    results = run(engine)
    assert len(results) == 4
    # The first sample prefills 100 tokens; the others reuse its 6 full blocks and compute 4 each.
    assert sum(computed) == 100 + 3 * 4


def test_stop_strings_cut_the_text_and_stop_tokens_end_the_completion(tiny_dir):
    engine = engine_for(tiny_dir)
    prompt = list(b"Once upon a time")

    def complete(request_id: str, **params) -> dict:
        # Seeded, so every run draws the same tokens until it stops.
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=40, seed=3, ignore_eos=True, **params))
        return run(engine)[(request_id, 0)]

    free = complete("free")
    ids = free["ids"]
    # A stop token ends the completion at its first occurrence, and is kept.
    tok = complete("tok", stop_token_ids=(ids[10],))
    assert tok["ids"] == ids[:ids.index(ids[10]) + 1] and tok["finish"] == "stop"
    # A stop string cuts the text before it; the token ids run up to the token that completed it.
    stop = next(ch for ch in free["text"][5:] if ch.isascii() and ch.isalnum())
    cut = complete("str", stop=(stop,))
    assert cut["finish"] == "stop" and cut["text"] == free["text"][:free["text"].index(stop)]
    assert ids[:len(cut["ids"])] == cut["ids"] and len(cut["ids"]) < 40
    kept = complete("kept", stop=(stop,), include_stop_str_in_output=True)
    assert kept["text"] == cut["text"] + stop


def test_eos_ends_the_completion_unless_ignored(tiny_dir):
    engine = engine_for(tiny_dir)
    assert engine.eos_token_ids == {256, 258}  # generation_config.json lists <|im_end|> and <|endoftext|>
    prompt = list(b"Once upon a time")
    engine.add_request("free", prompt, SamplingParams(max_tokens=40, seed=3, ignore_eos=True))
    ids = run(engine)[("free", 0)]["ids"]
    engine.eos_token_ids = {ids[5]}  # pretend a token the model samples is EOS
    engine.add_request("eos", prompt, SamplingParams(max_tokens=40, seed=3))
    stopped = run(engine)[("eos", 0)]
    assert stopped["finish"] == "stop" and stopped["ids"] == ids[:ids.index(ids[5]) + 1]
    engine.add_request("ignored", prompt, SamplingParams(max_tokens=40, seed=3, ignore_eos=True))
    assert run(engine)[("ignored", 0)]["finish"] == "length"


def test_weight_update_with_wrong_shapes_changes_nothing(tiny_dir, tiny_model):
    engine = engine_for(tiny_dir)
    state = load_state_dict(tiny_dir)
    bad = dict(state, **{"model.norm.weight": torch.ones(7)})
    before = {k: v.clone() for k, v in engine.weight_target.state_dict().items()}
    with pytest.raises(ValueError, match="shape mismatch for model.norm.weight"):
        engine.update_weights(bad)
    with pytest.raises(KeyError, match="missing"):
        engine.update_weights({k: v for k, v in state.items() if "layers.1." not in k})
    assert engine.weight_version == 0
    after = engine.weight_target.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_weight_update_forgets_the_prefix_cache(tiny_dir, tiny_other_dir):
    engine = engine_for(tiny_dir)
    prompt = list(range(60))
    engine.add_request("a", prompt, SamplingParams(max_tokens=1))
    run(engine)
    assert engine.block_manager.cached
    assert engine.update_weights(load_state_dict(tiny_other_dir)) == 1
    assert not engine.block_manager.cached
    assert engine.update_weights(load_state_dict(tiny_other_dir), version=7) == 7


def test_non_incremental_requests_get_one_output_with_everything(tiny_dir):
    engine = engine_for(tiny_dir)
    params = SamplingParams(max_tokens=30, seed=5, stop=("e",), ignore_eos=True)
    engine.add_request("inc", list(b"Once upon a time"), params, n=2)
    incremental = run(engine)
    engine.add_request("whole", list(b"Once upon a time"), params, n=2, incremental=False)
    outputs = []
    while engine.has_unfinished:
        outputs += engine.step()
    assert sorted(o.index for o in outputs) == [0, 1] and all(o.finish_reason for o in outputs)
    for out in outputs:
        expected = incremental[("inc", out.index)]
        assert (out.token_ids, out.logprobs, out.text, out.finish_reason) == (expected["ids"], expected["logprobs"], expected["text"], expected["finish"])
