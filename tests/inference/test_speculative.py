"""Speculative decoding: the tokens, their distribution and their logprobs are the policy's, drafts or not."""

import collections
import json
import random
import shutil

import httpx
import numpy as np
import openai
import pytest
import torch
from counting_head import give_counting_head
from inference_helpers import make_config, teacher_forced_logprobs
from pydantic import ValidationError
from test_admin import metric
from test_engine import engine_for, run
from test_fallback import tiny_llama

from tandem.config.inference import InferenceConfig
from tandem.inference.engine.model_runner import RecomputeModelRunner
from tandem.inference.engine.sampler import Sampler
from tandem.inference.engine.sampling_params import SamplingParams
from tandem.inference.engine import speculative
from tandem.inference.engine.speculative import NgramIndex, expected_accepted, steps_that_cannot_draft
from tandem.inference.server import BackgroundServer
from tandem.models.loading import load_causal_lm
from tandem.models.weights import load_state_dict, save_state_dict


@pytest.fixture(scope="module")
def blurred_dir(sharp_dir, tmp_path_factory):
    """A draft for `sharp_dir`: its weights with a flatter, noisy LM head, so that it is right about a third of
    the time (its drafts are accepted and rejected alike)."""
    folder = tmp_path_factory.mktemp("blurred") / "model"
    shutil.copytree(sharp_dir, folder)
    state = load_state_dict(folder)
    head = state["lm_head.weight"]
    noise = torch.randn(head.shape, generator=torch.Generator().manual_seed(0))
    state["lm_head.weight"] = 0.5 * head + 0.3 * noise
    save_state_dict(state, folder, json.loads((folder / "config.json").read_text()))
    return folder


def test_ngram_drafts_continue_the_latest_occurrence_of_the_longest_suffix():
    def drafts(tokens: list[int], ngram_max: int, num_drafts: int) -> list[int]:
        index = NgramIndex(ngram_max)
        index.extend(tokens[:len(tokens) // 2])  # grown in two steps, as a sequence grows
        index.extend(tokens)
        return index.drafts(num_drafts)

    tokens = [1, 2, 3, 9, 2, 3, 8, 7, 1, 2, 3]
    assert drafts(tokens, 3, 2) == [9, 2]  # "1 2 3" occurs at the start
    assert drafts(tokens, 2, 2) == [8, 7]  # "2 3": its latest earlier occurrence
    assert drafts(tokens, 1, 2) == [8, 7]  # "3" alone: the same place
    assert drafts(tokens, 3, 10) == [9, 2, 3, 8, 7, 1, 2, 3]  # as many as follow, up to the last token
    assert drafts([2, 3, 5, 2, 3], 4, 1) == [5]  # a match may start at the first token
    assert drafts([5, 6, 7], 3, 4) == []  # nothing earlier to copy
    assert drafts([4, 4, 4], 3, 4) == [4]  # the suffix may overlap what it proposes


def test_drafts_indexed_ahead_leave_the_index_of_the_tokens_that_came():
    """Drafts indexed while they are verified, then the tokens that came (some drafts accepted, then another
    token; or, after steps that did not look, many tokens at once): the index, its hit rate bit for bit and its
    drafts are those of indexing only the tokens that came."""
    rng = random.Random(5)
    for _ in range(20):
        piece = [rng.randrange(12) for _ in range(rng.randint(2, 6))]
        tokens = piece * 3 + [rng.randrange(12) for _ in range(rng.randint(1, 4))]
        ahead, plain = NgramIndex(3), NgramIndex(3)
        ahead.extend(tokens)
        plain.extend(tokens)
        for _ in range(30):
            drafts = ahead.drafts(4)
            ahead.extend_ahead(drafts)
            if rng.random() < 0.1:
                came = [rng.randrange(12) for _ in range(rng.randint(40, 80))]
            else:
                came = drafts[:rng.randint(0, len(drafts))] + [rng.randrange(12)]
            tokens += came
            ahead.extend(tokens)
            plain.extend(tokens)
            assert (ahead.tokens, ahead.latest, ahead.previous) == (plain.tokens, plain.latest, plain.previous)
            assert ahead.hit_rate == plain.hit_rate
            assert ahead.drafts(4) == plain.drafts(4)


def test_deterministic_drafts_are_accepted_up_to_the_first_row_that_samples_another_token():
    """Greedy rows: each draft that the row before samples is accepted; the first row that samples another token,
    or the last row, gives the sequence's own token; every emitted token reports its row's logprob."""

    class Drafting:
        """What `verify` reads of a sequence."""
        params = SamplingParams(max_tokens=8, temperature=0.0)
        generator = None

    drafts = [[3, 5, 1], [], [6, 6], [2]]
    samples = [3, 5, 2, 7, 4, 6, 6, 0, 1, 1]  # each row's argmax
    logits = torch.randn(len(samples), 8, generator=torch.Generator().manual_seed(0))
    logits[range(len(samples)), samples] += 10
    speculator = speculative.Speculator(speculative.NgramProposer(3, 1.0), Sampler(torch.device("cpu"), 0))
    result = speculator.verify(logits, [Drafting() for _ in drafts], drafts).result()
    logprobs = logits.log_softmax(-1)
    assert [[token for token, _, _ in accepted] for accepted in result.accepted_drafts] == [[3, 5], [], [6, 6], []]
    assert result.token_ids == [2, 4, 0, 1]
    emitted_rows = [[0, 1, 2], [4], [5, 6, 7], [8]]
    reported = [[logprob for _, logprob, _ in accepted] + [own]
                for accepted, own in zip(result.accepted_drafts, result.logprobs)]
    assert reported == [[pytest.approx(logprobs[r, samples[r]].item()) for r in rows] for rows in emitted_rows]


def seeded_requests(num: int) -> list[tuple[str, list[int], SamplingParams]]:
    """Prompts that repeat themselves (n-gram drafts find matches), with every stop and every kind of sampling."""
    rng = random.Random(3)
    requests = []
    for i in range(num):
        piece = [rng.randrange(256) for _ in range(rng.randint(3, 12))]
        prompt = piece * rng.randint(2, 4) + [rng.randrange(256) for _ in range(rng.randint(0, 6))]
        params = SamplingParams(max_tokens=rng.randint(1, 30), temperature=[0.0, 0.7, 1.0][i % 3],
                                top_k=[-1, 20][i % 2], top_p=[1.0, 0.9][i % 4 // 2], seed=i,
                                stop=("e",) if i % 5 == 0 else (), stop_token_ids=(piece[1],) if i % 5 == 1 else (),
                                ignore_eos=i % 2 == 0)
        requests.append((str(i), prompt, params))
    return requests


def assert_same_outputs(got: dict, expected: dict) -> None:
    """The same completions (tokens, text, finish reason), their logprobs within float rounding (a verifying
    forward's rows are computed in other batches than a decode step's)."""
    assert set(got) == set(expected)
    for key, r in expected.items():
        s = got[key]
        assert (s["ids"], s["text"], s["finish"]) == (r["ids"], r["text"], r["finish"]), key
        assert torch.allclose(torch.tensor(s["logprobs"]), torch.tensor(r["logprobs"]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("settings", [
    {},
    # A cache of 14 blocks and a 48-token budget: drafts share the budget, the free blocks run out, sequences
    # are preempted and recomputed.
    {"num_blocks": 14, "max_num_batched_tokens": 48, "max_model_len": 128},
], ids=["roomy", "memory-starved"])
@pytest.mark.parametrize("draft", ["ngram", "greedy-draft-model"])
def test_seeded_outputs_are_the_same_with_deterministic_drafts_on_or_off(tiny_dir, tiny_other_dir, settings, draft):
    speculative = ({"method": "ngram", "num_tokens": 3} if draft == "ngram"
                   else {"method": "draft_model", "draft_model": str(tiny_other_dir)})
    results = {}
    for spec in ({}, speculative):
        engine = engine_for(tiny_dir, speculative=spec, **settings)
        engine.eos_token_ids = {7, 33}  # tokens the tiny model samples: some completions stop at EOS
        out: dict = {}
        for k, (rid, prompt, params) in enumerate(seeded_requests(12)):
            engine.add_request(rid, prompt, params, n=2)
            if k % 4 == 3:  # later requests arrive while earlier ones run
                run(engine, out, max_steps=3)
        run(engine, out)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        results[bool(spec)] = out, engine.stats()
    (plain, _), (speculated, stats) = results[False], results[True]
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert {r["finish"] for r in plain.values()} == {"stop", "length"}
    if settings:
        assert stats.num_preemptions > 0
    assert len(plain) == 24
    assert_same_outputs(speculated, plain)


@pytest.mark.parametrize("speculative", [
    {"method": "ngram"},
    {"method": "draft_model", "draft_sampling": "greedy"},
    {"method": "draft_model", "draft_sampling": "sampled"},
], ids=["ngram", "greedy-draft-model", "sampled-draft-model"])
def test_logprobs_are_the_policys_teacher_forced_ones(tiny_dir, tiny_model, tiny_other_dir, speculative):
    if speculative["method"] == "draft_model":
        speculative = {**speculative, "draft_model": str(tiny_other_dir)}
    engine = engine_for(tiny_dir, speculative=speculative)
    requests = {}
    for rid, prompt, params in seeded_requests(9):
        requests[rid] = prompt, params
        engine.add_request(rid, prompt, SamplingParams(max_tokens=20, temperature=params.temperature,
                                                       top_k=params.top_k, seed=params.seed, num_top_logprobs=3,
                                                       ignore_eos=True))
    results = run(engine)
    assert engine.stats().num_accepted_tokens > 0
    for (rid, _), r in results.items():
        prompt, params = requests[rid]
        expected = teacher_forced_logprobs(tiny_model, prompt, r["ids"], params.temperature)
        assert len(r["ids"]) == 20
        assert torch.allclose(torch.tensor(r["logprobs"]), expected, atol=1e-5, rtol=0)


def test_a_sampled_draft_gives_the_same_tokens_for_the_same_seed(tiny_dir, tiny_other_dir):
    speculative = {"method": "draft_model", "draft_model": str(tiny_other_dir), "draft_sampling": "sampled"}
    outputs = []
    for _ in range(2):
        engine = engine_for(tiny_dir, speculative=speculative)
        for rid, prompt, params in seeded_requests(6):
            engine.add_request(rid, prompt, params, n=2)
        outputs.append(run(engine))
    assert outputs[0] == outputs[1]


@pytest.fixture(scope="module")
def counting_moe_dir(tiny_moe_dir, tmp_path_factory):
    """The tiny mixture of experts with `sharp_dir`'s counting LM head (token t's embedding maps to t + 1): its
    greedy completions of a counting prompt go on counting, so n-gram drafts copied from the prompt are accepted
    and the accepted tokens differ from each other."""
    folder = tmp_path_factory.mktemp("counting_moe") / "model"
    shutil.copytree(tiny_moe_dir, folder)
    return give_counting_head(folder)


def test_routed_experts_are_those_of_the_forward_that_sampled_each_token(counting_moe_dir):
    """A mixture of experts reports, for an accepted draft as for any token, the experts of the row that gave
    it: the same as without speculation."""
    routed = {}
    for spec in ({}, {"method": "ngram"}):
        engine = engine_for(counting_moe_dir, speculative=spec)
        for i in range(4):
            prompt = list(range(10 * i, 10 * i + 40)) + list(range(10 * i, 10 * i + 3))
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=16, temperature=[0.0, 0.7][i % 2], seed=i,
                                                              ignore_eos=True, return_routed_experts=True))
        experts: dict = collections.defaultdict(list)
        while engine.has_unfinished:
            for out in engine.step():
                assert len(out.routed_experts) == len(out.token_ids)
                experts[out.request_id] += out.routed_experts
        routed[bool(spec)] = experts, engine.stats()
    (plain, _), (speculated, stats) = routed[False], routed[True]
    assert stats.num_accepted_tokens > 0
    assert speculated == plain


def chi_square_p_value(a: list[list[int]], b: list[list[int]], positions: range) -> float:
    """Two equal-sized samples of completions: the p-value of "the tokens at each of `positions` have the same
    distribution in both" (a chi-square test of homogeneity; rare tokens of a position pooled)."""
    count_a = collections.Counter((p, ids[p]) for ids in a for p in positions)
    count_b = collections.Counter((p, ids[p]) for ids in b for p in positions)
    statistic, dof = 0.0, 0
    for p in positions:
        cells = {key for key in count_a.keys() | count_b.keys() if key[0] == p}
        common = [key for key in cells if count_a[key] + count_b[key] >= 10]
        pairs = [(count_a[key], count_b[key]) for key in common]
        rare = (sum(count_a[key] for key in cells - set(common)), sum(count_b[key] for key in cells - set(common)))
        pairs += [rare] if sum(rare) else []
        statistic += sum((x - y) ** 2 / (x + y) for x, y in pairs)
        dof += len(pairs) - 1
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                   torch.tensor(statistic / 2, dtype=torch.float64)).item()


def fit_p_value(model, prompt: list[int], completions: list[list[int]], temperature: float, position: int) -> float:
    """The p-value of "each completion's token at `position` is drawn from the policy's distribution after its
    prompt and earlier tokens" (a chi-square goodness-of-fit over the contexts that at least 50 completions share,
    against the teacher-forced distribution of each; unlikely tokens pooled)."""
    groups = collections.defaultdict(list)
    for ids in completions:
        groups[tuple(ids[:position])].append(ids[position])
    statistic, dof = 0.0, 0
    for context, tokens in groups.items():
        if len(tokens) < 50:
            continue
        ids = torch.tensor([prompt + list(context)])
        with torch.no_grad():
            logits = model.lm_head(model(ids, torch.arange(ids.shape[1])[None]))[0, -1].float()
        expected = len(tokens) * (logits / temperature).softmax(-1)
        observed = torch.bincount(torch.tensor(tokens), minlength=expected.shape[0]).double()
        common = expected >= 5
        cells = [(observed[common], expected[common]), (observed[~common].sum()[None], expected[~common].sum()[None])]
        statistic += sum((((o - e) ** 2) / e).sum().item() for o, e in cells)
        dof += int(common.sum())  # the common tokens and the pooled rest, less one
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                   torch.tensor(statistic / 2, dtype=torch.float64)).item()


@pytest.mark.parametrize("temperature", [0.6, 1.0])
def test_a_sampled_draft_keeps_the_policys_distribution(sharp_dir, blurred_dir, temperature):
    """Many seeded completions of one prompt: their 2nd to 4th tokens (the ones verified against drafts) are
    distributed alike with and without a draft model that samples and is often wrong, and unlike the draft's own;
    and they fit the policy's teacher-forced distributions."""
    settings = {"num_blocks": 1200, "max_model_len": 64, "max_num_seqs": 512, "max_num_batched_tokens": 2048}
    prompt = list(b"Once upon a time, there was")  # its first block is shared, the rest prefilled as a batch

    def completions(folder, seed: int, **speculative) -> tuple[list[list[int]], object]:
        engine = engine_for(folder, speculative=speculative, **settings)
        params = SamplingParams(max_tokens=4, temperature=temperature, seed=seed, ignore_eos=True)
        engine.add_request("r", prompt, params, n=400, incremental=False)
        outputs = []
        while engine.has_unfinished:
            outputs += engine.step()
        return [out.token_ids for out in outputs], engine.stats()

    plain, _ = completions(sharp_dir, seed=0)
    speculated, stats = completions(sharp_dir, seed=10**6, method="draft_model", draft_model=str(blurred_dir),
                                    draft_sampling="sampled", num_tokens=3)
    drafts_own, _ = completions(blurred_dir, seed=2 * 10**6)
    assert 0.15 < stats.num_accepted_tokens / stats.num_draft_tokens < 0.6
    assert chi_square_p_value(plain, speculated, range(1, 4)) > 0.01
    assert chi_square_p_value(plain, drafts_own, range(1, 4)) < 1e-6  # the test tells the draft from the policy
    # Stronger: the tokens fit the policy's own teacher-forced distribution, context by context.
    policy = load_causal_lm(str(sharp_dir))
    assert fit_p_value(policy, prompt, speculated, temperature, 1) > 0.01
    assert fit_p_value(policy, prompt, speculated, temperature, 2) > 0.01
    assert fit_p_value(policy, prompt, drafts_own, temperature, 1) < 1e-6


def test_the_recompute_path_speculates_too(tmp_path):
    """Models without a paged cache (transformers models) verify drafts in their full forward."""
    folder = tiny_llama(tmp_path / "llama", seed=0)
    model = load_causal_lm(str(folder))
    results = {}
    for spec in ({}, {"method": "ngram"}):
        engine = engine_for(folder, speculative=spec)
        assert isinstance(engine.runner, RecomputeModelRunner)
        for rid, prompt, params in seeded_requests(6):
            engine.add_request(rid, prompt, params)
        results[bool(spec)] = run(engine), engine.stats()
    (plain, _), (speculated, stats) = results[False], results[True]
    assert stats.num_accepted_tokens > 0
    assert plain.keys() == speculated.keys()
    for key, r in speculated.items():
        assert (r["ids"], r["text"], r["finish"]) == (plain[key]["ids"], plain[key]["text"], plain[key]["finish"])
        prompt, params = next((p, q) for rid, p, q in seeded_requests(6) if rid == key[0])
        expected = teacher_forced_logprobs(model, prompt, r["ids"], params.temperature)
        assert torch.allclose(torch.tensor(r["logprobs"]), expected, atol=1e-5, rtol=0)


def test_answers_and_metrics_count_drafted_and_accepted_tokens(tiny_dir):
    """Each answer's `usage.completion_tokens_details` (what an RL run logs per step; the official client reads
    it, a stream's last chunk included) counts the drafts of its own tokens, and `/metrics` the server's: the
    answers add up to the counters."""
    config = make_config(tiny_dir, speculative={"method": "ngram"})
    running = BackgroundServer(config)
    try:
        before = httpx.get(f"{running.url}/metrics").text
        generated = httpx.post(f"{running.url}/v1/generate", timeout=60, json={
            "prompt_token_ids": [5, 6, 7, 8] * 8, "max_tokens": 30, "temperature": 0, "ignore_eos": True, "n": 2}).json()
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused")
        completed = client.completions.create(model=str(tiny_dir), prompt=[5, 6, 7, 8] * 8, max_tokens=30, temperature=0,
                                              extra_body={"ignore_eos": True})
        streamed = [chunk.usage for chunk in client.completions.create(
            model=str(tiny_dir), prompt=[5, 6, 7, 8] * 8, max_tokens=30, temperature=0, n=2, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}) if chunk.usage is not None]
        after = httpx.get(f"{running.url}/metrics").text
    finally:
        running.stop()
    drafted, accepted = (metric(after, name) - metric(before, name) for name in
                         ("tandem_spec_decode_draft_tokens_total", "tandem_spec_decode_accepted_tokens_total"))
    assert drafted >= accepted > 0
    details = generated["usage"]["completion_tokens_details"]
    assert len(streamed) == 1 and streamed[0].completion_tokens == 60
    official = [completed.usage.completion_tokens_details, streamed[0].completion_tokens_details]
    assert details["accepted_prediction_tokens"] > 0 and all(o.accepted_prediction_tokens > 0 for o in official)
    assert details["accepted_prediction_tokens"] + sum(o.accepted_prediction_tokens for o in official) == accepted
    assert (details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"]
            + sum(o.accepted_prediction_tokens + o.rejected_prediction_tokens for o in official)) == drafted


def test_a_draft_of_another_vocabulary_is_refused_naming_both(tiny_dir, tmp_path):
    folder = tmp_path / "wider"
    shutil.copytree(tiny_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["vocab_size"] += 64
    (folder / "config.json").write_text(json.dumps(config))
    state = load_state_dict(folder)
    embed = state["model.embed_tokens.weight"]
    state["model.embed_tokens.weight"] = torch.cat([embed, embed[:64]])
    save_state_dict(state, folder, config)
    with pytest.raises(ValueError, match="vocabulary") as err:
        engine_for(tiny_dir, speculative={"method": "draft_model", "draft_model": str(folder)})
    message = str(err.value)
    assert "`engine.speculative.draft_model`" in message and str(folder) in message and str(tiny_dir) in message
    assert str(config["vocab_size"]) in message and str(config["vocab_size"] - 64) in message


@pytest.mark.parametrize(("settings", "expected"), [
    ({"engine": {"speculative": {"method": "draft_model"}}}, "engine.speculative.draft_model"),
    ({"engine": {"speculative": {"draft_model": "/some/folder"}}}, "engine.speculative.method"),
])
def test_speculation_is_refused_where_it_cannot_hold(tiny_dir, settings, expected):
    with pytest.raises(ValidationError, match=expected.replace(".", r"\.")):
        InferenceConfig.model_validate({"model": {"name": str(tiny_dir)}, **settings})


def test_exact_mode_speculates(tiny_dir):
    """`run.exact` with speculation resolves: the verifying forward keeps exact mode's parity
    (`tests/trainer/test_exact_parity.py`)."""
    config = InferenceConfig.model_validate({"model": {"name": str(tiny_dir)}, "run": {"exact": True},
                                             "engine": {"speculative": {"method": "ngram"}}})
    assert config.run.exact and config.engine.speculative.enabled


def test_overlapped_steps_give_the_same_tokens_with_ngram_drafts(tiny_dir):
    """With `overlap` (CUDA's default), a step that drafts first reads the step in flight and is read at once, and
    the steps that do not draft stay overlapped: the seeded outputs are those of reading every step without
    speculation."""
    results = {}
    for overlap, spec in ((False, {}), (True, {"method": "ngram", "num_tokens": 3, "min_expected_tokens": 0.3})):
        engine = engine_for(tiny_dir, overlap, speculative=spec)
        engine.eos_token_ids = {7, 33}
        out: dict = {}
        for k, (rid, prompt, params) in enumerate(seeded_requests(12)):
            engine.add_request(rid, prompt, params, n=2)
            if k % 4 == 3:
                run(engine, out, max_steps=3)
        run(engine, out)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        results[overlap] = out, engine.stats()
    (plain, _), (speculated, stats) = results[False], results[True]
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert len(plain) == 24
    assert_same_outputs(speculated, plain)


def test_sequences_that_lookup_does_not_guess_are_not_drafted_for(tiny_dir):
    """Prompts that never repeat, sampled at T = 1: prompt lookup's first draft is almost never the next token,
    so by default no step drafts (each would cost a verifying step for nothing); with `min_expected_tokens` = 0
    steps draft wherever lookup finds a match. The tokens are the same either way."""
    rng = random.Random(5)
    prompts = [[rng.randrange(256) for _ in range(40)] for _ in range(8)]
    results = {}
    for minimum in (0.5, 0.0):
        engine = engine_for(tiny_dir, speculative={"method": "ngram", "min_expected_tokens": minimum})
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=24, temperature=1.0, seed=i, ignore_eos=True))
        results[minimum] = run(engine), engine.stats()
    (adaptive, stats), (always, always_stats) = results[0.5], results[0.0]
    assert stats.num_draft_tokens == 0 < always_stats.num_draft_tokens
    assert_same_outputs(adaptive, always)


def test_the_quiet_steps_are_those_in_which_no_hit_rate_can_climb_to_the_bar():
    """After m quiet steps, even a hit at every token leaves the rates short of the bar; one more could reach it."""
    rates = np.array([0.0, 0.1, 0.2, 0.05])
    m = steps_that_cannot_draft(rates, 4, 0.5, most=32)
    assert 0 < m < 32
    step = 1 - 1 / NgramIndex.HIT_RATE_TOKENS
    for steps, reaches in ((m, False), (m + 1, True)):
        best = 1 - (1 - rates) * step ** steps
        assert bool(expected_accepted(best, 4).mean() >= 0.5) == reaches
    assert steps_that_cannot_draft(rates, 4, 0.01, most=32) == 0  # within reach at the next step
    assert steps_that_cannot_draft(np.zeros(3), 4, 4.0, most=32) == 32  # never: every draft right each step


def test_a_declining_rule_waits_without_looking_and_decides_as_if_it_looked_every_step(tiny_dir, monkeypatch):
    """Where the drafting rule declines, the steps in which the hit rates cannot climb to its bar decline without
    indexing or scoring any sequence, so a step that does not draft costs the host no lookup work (and none
    reserves room for drafts or proposes any); the rule's decisions and the tokens are those of looking every step
    (the indexes catch up when it looks again)."""
    rng = random.Random(11)
    prompts = [[rng.randrange(256) for _ in range(30)] for _ in range(6)]
    prompts += [[rng.randrange(256) for _ in range(5)] * 6 for _ in range(2)]  # lookup guesses these
    calls = collections.Counter()
    for method in ("extend", "drafts"):
        def counted(self, *args, _method=getattr(NgramIndex, method), _name=method):
            calls[_name] += 1
            return _method(self, *args)
        monkeypatch.setattr(NgramIndex, method, counted)
    runs = {}
    for looks_every_step in (False, True):
        if looks_every_step:
            monkeypatch.setattr(speculative, "steps_that_cannot_draft", lambda *args, **kwargs: 0)
        engine = engine_for(tiny_dir, overlap=True, speculative={"method": "ngram", "min_expected_tokens": 0.3})
        should_draft = engine.speculator.should_draft
        decisions = []

        def recorded(running, num_drafts, _should_draft=should_draft, _decisions=decisions):
            before = calls["extend"] + calls["drafts"]
            decision = _should_draft(running, num_drafts)
            _decisions.append((decision, calls["extend"] + calls["drafts"] - before))
            return decision

        engine.speculator.should_draft = recorded
        propose = engine.speculator.propose
        proposed = []  # per launched step: the rule's decision, and whether the batch had room for drafts, drafts or
        # a lookup

        def recorded_propose(batch, _propose=propose, _proposed=proposed, _decisions=decisions):
            before = calls["drafts"]
            _propose(batch)
            _proposed.append((_decisions[-1][0], any(batch.num_lookahead) or batch.has_drafts or calls["drafts"] > before))

        engine.speculator.propose = recorded_propose
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=40, temperature=1.0 if i < 6 else 0.0,
                                                              seed=i, ignore_eos=True))
        runs[looks_every_step] = run(engine), decisions, engine.stats()
        assert not any(drafting for decided, drafting in proposed if not decided)  # declined: no room, lookup or draft
        assert any(drafting for _, drafting in proposed)
    (quiet_out, quiet, stats), (every_out, every, _) = runs[False], runs[True]
    assert [d for d, _ in quiet] == [d for d, _ in every]
    assert any(d for d, _ in quiet) and stats.num_draft_tokens > 0
    declined_quiet = [work for decision, work in quiet[1:] if not decision]  # after the first: nothing decodes
    declined_every = [work for decision, work in every[1:] if not decision]
    assert len(declined_quiet) > 8
    assert declined_quiet.count(0) >= len(declined_quiet) // 2 and declined_every.count(0) <= 2
    assert sum(declined_quiet) < sum(declined_every) / 2  # tokens indexed in one go when the rule looks again
    assert_same_outputs(quiet_out, every_out)
