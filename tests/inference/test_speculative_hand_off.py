"""Speculative decoding on a decode server (prefill/decode disaggregation), the engine's halves without HTTP: a
prompt prefilled by another engine samples its first token from the handed row in a step that verifies other
sequences' drafts, and then drafts as if this engine had prefilled it.

Every engine runs `run.exact` (batch-invariant), so a token's numbers do not depend on the batch that computed it:
with deterministic drafts the tokens and logprobs are bit for bit those of one engine, with or without
speculation, and the MTP layer's drafts are one engine's too.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_prefilled import prefill_on

from tandem.config.base import ModelConfig
from tandem.config.inference import EngineConfig
from tandem.inference.engine.sampling_params import SamplingParams
from tandem.inference.engine.setup import build_engine
from tandem.models.presets import PRESETS, shape_config, write_model

BUSY_PROMPT = list(range(10, 40)) + list(range(10, 13))
"""Under a counting head the model goes on counting from 13: prompt lookup drafts for it from its first decode step."""
HANDED_PROMPT = list(range(100, 140)) + list(range(100, 130))
"""Long enough to be handed over (several blocks), and counting too."""
BUSY = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
HANDED = SamplingParams(max_tokens=16, temperature=1.0, seed=2, ignore_eos=True)


def exact_engine(folder, speculative: dict, overlap: bool = False):
    """`overlap`: what CUDA does by default (launch a step before reading the last), which n-gram drafts keep."""
    config = EngineConfig(device="cpu", num_blocks=128, block_size=16, max_model_len=256, max_num_batched_tokens=256,
                          speculative=speculative)
    engine = build_engine(ModelConfig(name=str(folder)), config, seed=0, exact=True)
    engine.overlap = overlap
    return engine


def run_all(engine, results: dict, max_steps: int | None = None) -> dict:
    """Step until idle (or `max_steps`); per (request, index): token ids, logprobs, drafted and accepted counts."""
    steps = 0
    while engine.has_unfinished and (max_steps is None or steps < max_steps):
        steps += 1
        for out in engine.step():
            if out.prefilled is not None:  # a prefill-only request's result
                results[out.request_id] = out.prefilled
                continue
            r = results.setdefault((out.request_id, out.index), {"ids": [], "logprobs": []})
            r["ids"] += out.token_ids
            r["logprobs"] += out.logprobs
            r["drafted"], r["accepted"] = out.num_draft_tokens, out.num_accepted_tokens
    return results


def serve(engine, prefilled=None) -> dict:
    """A request decoding with drafts, then the handed prompt (n = 2) arriving: continued from `prefilled` where
    given, else prefilled here."""
    engine.add_request("busy", BUSY_PROMPT, BUSY)
    results = run_all(engine, {}, max_steps=2)
    if prefilled is None:
        engine.add_request("handed", HANDED_PROMPT, HANDED, n=2)
    else:
        engine.add_prefilled("handed", HANDED_PROMPT, HANDED, 2, True, prefilled)
    return run_all(engine, results)


def record_verified(engine) -> list[tuple[str, bool, int]]:
    """Per sequence of every verifying step: its request, whether it samples its first token, its drafts."""
    verify = engine.speculator.verify
    seen = []

    def recording(logits, seqs, drafts):
        seen.extend((seq.request_id, not seq.completion_token_ids, len(d)) for seq, d in zip(seqs, drafts))
        return verify(logits, seqs, drafts)

    engine.speculator.verify = recording
    return seen


def record_drafts(engine) -> list[tuple[str, int, int, list[int]]]:
    """Every proposal: the sequence (request, index), how many tokens it held, the drafts proposed after them (an
    engine that took the prompt over runs its sequences' steps in other batches than one that prefilled it: compare
    them sorted)."""
    proposer = engine.speculator.proposer
    propose = proposer.propose
    seen = []

    def recording(batch):
        distributions = propose(batch)
        seen.extend((s.request_id, s.index, s.num_tokens, d) for s, d in zip(batch.seqs, batch.drafts) if d)
        return distributions

    proposer.propose = recording
    return seen


def tokens_and_logprobs(results: dict) -> dict:
    return {key: (r["ids"], r["logprobs"]) for key, r in results.items()}


@pytest.mark.parametrize("method, overlap", [("ngram", False), ("ngram", True), ("draft_model", False)],
                         ids=["ngram", "ngram-overlap", "draft_model"])
def test_a_handed_prompt_joins_a_verifying_step_and_the_tokens_are_one_engines(sharp_dir, method, overlap):
    """The handed prompt's first token is sampled, as a sequence with no drafts, in a step that verifies the busy
    request's drafts; then it drafts too (n-gram: its index holds the handed prompt; a draft model: it ran its own
    prefill over the prompt). Bit for bit the tokens and logprobs of one engine with the same drafts, and of one
    without speculation."""
    speculative = ({"method": "ngram", "num_tokens": 3, "min_expected_tokens": 0} if method == "ngram"
                   else {"method": "draft_model", "draft_model": str(sharp_dir), "num_tokens": 3})
    prefilled = prefill_on(exact_engine(sharp_dir, speculative), HANDED_PROMPT)
    assert prefilled.draft_state is None  # n-gram and draft-model drafts need nothing but the blocks
    decode = exact_engine(sharp_dir, speculative, overlap)
    verified = record_verified(decode)
    got = serve(decode, prefilled)
    colocated = serve(exact_engine(sharp_dir, speculative, overlap))
    plain = serve(exact_engine(sharp_dir, {}))
    assert decode.num_prefilled_taken == 1 and len(got) == 3
    assert got == colocated
    assert tokens_and_logprobs(got) == tokens_and_logprobs(plain)
    assert ("handed", True, 0) in verified and any(r == "busy" and d > 0 for r, _, d in verified)
    assert got["handed", 0]["accepted"] > 0  # the sample that continued from the handed blocks
    assert decode.block_manager.num_free_blocks == decode.block_manager.num_blocks


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_a_handed_prompt_alone_samples_its_first_token_in_a_step_with_no_forward(sharp_dir, method):
    """Nothing else runs: the step that samples the handed row computes nothing, and the draft sees no step."""
    speculative = {"method": method, "num_tokens": 3, **({"draft_model": str(sharp_dir)} if method == "draft_model"
                                                         else {"min_expected_tokens": 0})}
    prefilled = prefill_on(exact_engine(sharp_dir, speculative), HANDED_PROMPT)
    decode, colocated = exact_engine(sharp_dir, speculative), exact_engine(sharp_dir, speculative)
    decode.add_prefilled("handed", HANDED_PROMPT, HANDED, 1, True, prefilled)
    colocated.add_request("handed", HANDED_PROMPT, HANDED)
    got = run_all(decode, {})
    assert got == run_all(colocated, {}) and got["handed", 0]["accepted"] > 0


def test_a_speculating_prefill_engine_hands_a_prompt_over_from_a_step_that_verifies_drafts(sharp_dir):
    """A prefill server serves its own requests too: a prompt computed for a decode server beside a sequence whose
    drafts the step verifies (its rows after that sequence's 1 + drafts) hands over the blocks and logits row of an
    engine without speculation, and the other sequence's tokens are those without speculation."""
    speculative = {"method": "ngram", "num_tokens": 3, "min_expected_tokens": 0}
    engine = exact_engine(sharp_dir, speculative)
    hand_off = engine._hand_off
    drafts_beside = []

    def recording(logits, sampling, drafts):
        drafts_beside.extend(len(d) for d in drafts)
        return hand_off(logits, sampling, drafts)

    engine._hand_off = recording
    engine.add_request("busy", BUSY_PROMPT, BUSY)
    results = run_all(engine, {}, max_steps=2)
    engine.add_prefill("p", HANDED_PROMPT)
    results = run_all(engine, results)
    assert drafts_beside == [3, 0]  # the busy request's 3 drafts, the prompt's none
    want = prefill_on(exact_engine(sharp_dir, {}), HANDED_PROMPT)
    assert torch.equal(results["p"].logits, want.logits) and torch.equal(results["p"].kv_blocks, want.kv_blocks)
    plain = exact_engine(sharp_dir, {})
    plain.add_request("busy", BUSY_PROMPT, BUSY)
    assert tokens_and_logprobs({"busy": results["busy", 0]}) == tokens_and_logprobs({"busy": run_all(plain, {})["busy", 0]})
    assert results["busy", 0]["accepted"] > 0


def test_a_draft_model_that_skipped_the_handed_prompt_would_draft_otherwise(sharp_dir):
    """The check above can fail: a decode engine whose draft model does not prefill the handed prompt drafts from
    an empty cache there, and its drafts (so its accepted counts) are not one engine's."""
    speculative = {"method": "draft_model", "draft_model": str(sharp_dir), "num_tokens": 3}
    prefilled = prefill_on(exact_engine(sharp_dir, speculative), HANDED_PROMPT)
    decode = exact_engine(sharp_dir, speculative)
    decode.speculator.proposer.take_over = lambda seq, start, state: None
    got, colocated = serve(decode, prefilled), serve(exact_engine(sharp_dir, speculative))
    assert tokens_and_logprobs(got) == tokens_and_logprobs(colocated)  # the tokens are the policy's either way
    assert [got["handed", i]["accepted"] for i in range(2)] != [colocated["handed", i]["accepted"] for i in range(2)]


@pytest.fixture(scope="module")
def glm5_dir(tmp_path_factory):
    """tiny-glm5 (one MTP layer) with a DSA top-k below the prompts, so the MTP layer's indexer chooses too."""
    return write_model(shape_config(dict(PRESETS["tiny-glm5"], index_topk=8)), tmp_path_factory.mktemp("glm5") / "m")


MTP = {"method": "mtp", "num_tokens": 3}


def test_mtp_drafts_for_a_handed_prompt_are_one_engines(glm5_dir):
    """A prefill engine with MTP writes the layer's entries into the blocks it hands over and hands the policy's
    hidden state at the last prompt position: the decode engine's drafts are then, proposal by proposal, one
    engine's, from the handed prompt's first decode step on. Without the hidden state it drafts from the second
    step; with the layer's entries zeroed in the blocks its drafts are others (so the handed entries are read)."""
    prefilled = prefill_on(exact_engine(glm5_dir, MTP), HANDED_PROMPT)
    assert prefilled.draft_state is not None and prefilled.draft_state.shape == (PRESETS["tiny-glm5"]["hidden_size"],)
    colocated = exact_engine(glm5_dir, MTP)
    want_drafts = record_drafts(colocated)
    want = serve(colocated)
    assert tokens_and_logprobs(want) == tokens_and_logprobs(serve(exact_engine(glm5_dir, {})))

    def drafts_with(handed) -> tuple[dict, list]:
        decode = exact_engine(glm5_dir, MTP)
        drafts = record_drafts(decode)
        return serve(decode, handed), drafts

    got, got_drafts = drafts_with(prefilled)
    assert got == want and sorted(got_drafts) == sorted(want_drafts)
    assert any(r == "handed" for r, *_ in got_drafts)

    stateless, stateless_drafts = drafts_with(dataclasses.replace(prefilled, draft_state=None))
    assert tokens_and_logprobs(stateless) == tokens_and_logprobs(want)
    first_draft = {(r, i): n for r, i, n, _ in reversed(stateless_drafts) if r == "handed"}  # its tokens then
    # The sample that continued from the handed blocks drafts from its second step; the other computed its last
    # partial block here, so drafted from its first.
    assert first_draft == {("handed", 0): len(HANDED_PROMPT) + 2, ("handed", 1): len(HANDED_PROMPT) + 1}

    args = PRESETS["tiny-glm5"]
    entry = args["kv_lora_rank"] + args["qk_rope_head_dim"]
    mtp_columns = slice(args["num_hidden_layers"] * entry, (args["num_hidden_layers"] + 1) * entry)
    blocks = prefilled.kv_blocks.clone()
    blocks[..., mtp_columns] = 0
    _, blind_drafts = drafts_with(dataclasses.replace(prefilled, kv_blocks=blocks))
    assert sorted(d for d in blind_drafts if d[0] == "handed") != sorted(d for d in want_drafts if d[0] == "handed")
