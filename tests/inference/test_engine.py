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


def engine_for(model_dir, overlap: bool = False, dtype: str = "auto", **settings):
    """A CPU engine; `overlap` turns on what CUDA does by default (launch a step before reading the last)."""
    config = {"device": "cpu", "num_blocks": 256, "block_size": 16, "max_model_len": 512, "max_num_batched_tokens": 512,
              "overlap_steps": overlap, **settings}
    engine = build_engine(ModelConfig(name=str(model_dir), dtype=dtype), EngineConfig(**config), seed=0)
    engine.overlap = overlap
    return engine


def run(engine, results: dict | None = None, max_steps: int | None = None) -> dict[tuple[str, int], dict]:
    """Step until idle (or `max_steps`); per (request, index): token ids, logprobs, text, finish reason, and the
    experts of each token where the request asked for them."""
    results = {} if results is None else results
    steps = 0
    while engine.has_unfinished and (max_steps is None or steps < max_steps):
        steps += 1
        for out in engine.step():
            r = results.setdefault((out.request_id, out.index),
                                   {"ids": [], "logprobs": [], "text": "", "finish": None, "routed_experts": []})
            r["ids"] += out.token_ids
            r["logprobs"] += out.logprobs
            r["routed_experts"] += out.routed_experts
            r["text"] += out.text
            r["finish"] = out.finish_reason
    return results


@pytest.mark.parametrize("overlap", [False, True], ids=["read-each-step", "overlap"])
@pytest.mark.parametrize("settings", [
    {},
    # A cache of 12 blocks and a 40-token budget: chunked prefills and preemptions all along.
    {"num_blocks": 12, "max_num_batched_tokens": 40, "max_model_len": 160},
], ids=["roomy", "memory-starved"])
def test_logprobs_match_a_teacher_forced_pass(tiny_dir, tiny_model, settings, overlap):
    engine = engine_for(tiny_dir, overlap, **settings)
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


@pytest.mark.parametrize("folder", ["tiny_moe_dir", "tiny_glm_dir"])
def test_mixture_of_experts_logprobs_match_a_teacher_forced_pass(folder, request):
    """Sparse models run through the paged path (chunked prefills, batched decodes) as they are."""
    from tandem.models.loading import load_causal_lm

    folder = request.getfixturevalue(folder)
    engine = engine_for(folder, num_blocks=24, max_num_batched_tokens=48, max_model_len=160)
    model = load_causal_lm(str(folder))
    rng = random.Random(1)
    requests = {}
    for i in range(6):
        prompt = [rng.randrange(256) for _ in range(rng.randint(1, 80))]
        requests[str(i)] = prompt
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=i, ignore_eos=True))
    results = run(engine)
    assert len(results) == 6
    for (rid, _), r in results.items():
        expected = teacher_forced_logprobs(model, requests[rid], r["ids"], 1.0)
        assert len(r["ids"]) == 16
        assert torch.allclose(torch.tensor(r["logprobs"]), expected, atol=1e-5, rtol=0)


def test_dummy_weights_serve_a_folder_without_weights(tiny_moe_dir, tmp_path):
    """`model.load_format = "dummy"` builds `tandem model init`'s weights on the device from a config-only folder."""
    from tandem.models.presets import init_model

    folder = init_model("tiny-moe", tmp_path / "config-only", weights=False)
    engine = build_engine(ModelConfig(name=str(folder), load_format="dummy"),
                          EngineConfig(device="cpu", num_blocks=64, max_model_len=256), seed=0)
    expected = load_state_dict(tiny_moe_dir)
    for name, tensor in engine.runner.model.state_dict().items():
        assert torch.equal(tensor, expected.get(name, expected["model.embed_tokens.weight"])), name  # tied head


@pytest.mark.parametrize("overlap", [False, True], ids=["read-each-step", "overlap"])
def test_n_samples_share_the_prompt_prefill(tiny_dir, overlap):
    engine = engine_for(tiny_dir, overlap)
    computed = []
    run_batch = engine.runner.run
    engine.runner.run = lambda batch, previous: (computed.append(batch.num_tokens), run_batch(batch, previous))[1]
    engine.add_request("r", list(range(100)), SamplingParams(max_tokens=1), n=4)
    results = run(engine)
    assert len(results) == 4
    # The first sample prefills 100 tokens; the others reuse its 6 full blocks and compute 4 each.
    assert sum(computed) == 100 + 3 * 4


@pytest.mark.parametrize("overlap", [False, True], ids=["read-each-step", "overlap"])
def test_stop_strings_cut_the_text_and_stop_tokens_end_the_completion(tiny_dir, overlap):
    engine = engine_for(tiny_dir, overlap)
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


@pytest.mark.parametrize("overlap", [False, True], ids=["read-each-step", "overlap"])
def test_eos_ends_the_completion_unless_ignored(tiny_dir, overlap):
    engine = engine_for(tiny_dir, overlap)
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


@pytest.mark.parametrize("overlap", [False, True], ids=["read-each-step", "overlap"])
def test_non_incremental_requests_get_one_output_with_everything(tiny_dir, overlap):
    engine = engine_for(tiny_dir, overlap)
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


def test_overlap_gives_what_reading_each_step_gives(tiny_dir):
    """Seeded requests that stop at EOS, stop tokens, stop strings and `max_tokens`, arriving while
    others run, in a cache small enough to preempt: the same tokens, logprobs, texts and reasons."""
    rng = random.Random(1)
    requests = []
    for i in range(16):
        prompt = [rng.randrange(256) for _ in range(rng.randint(1, 60))]
        params = SamplingParams(max_tokens=rng.randint(1, 30), temperature=[0.0, 1.0][i % 2], seed=i,
                                stop=("e",) if i % 3 == 0 else (), stop_token_ids=(rng.randrange(256),) if i % 3 == 1 else ())
        requests.append((str(i), prompt, params))
    results = {}
    for overlap in (False, True):
        engine = engine_for(tiny_dir, overlap, num_blocks=14, max_num_batched_tokens=48, max_model_len=128)
        engine.eos_token_ids = {7, 33}  # tokens the tiny model samples: some completions stop at EOS
        out: dict = {}
        for k, (rid, prompt, params) in enumerate(requests):
            engine.add_request(rid, prompt, params, n=2)
            if k % 4 == 3:  # later requests arrive while earlier ones run
                run(engine, out, max_steps=3)
        run(engine, out)
        assert engine.block_manager.usage == 0 and engine.in_flight is None
        results[overlap] = (out, engine.scheduler.num_preemptions)
    (plain, plain_preempted), (overlapped, overlap_preempted) = results[False], results[True]
    assert plain_preempted > 0 and overlap_preempted > 0
    assert set(plain) == set(overlapped) and len(plain) == 32
    reasons = {r["finish"] for r in plain.values()}
    assert reasons == {"stop", "length"}
    for key, r in plain.items():
        o = overlapped[key]
        assert (o["ids"], o["text"], o["finish"]) == (r["ids"], r["text"], r["finish"]), key
        assert torch.allclose(torch.tensor(o["logprobs"]), torch.tensor(r["logprobs"]), atol=1e-5, rtol=0)
