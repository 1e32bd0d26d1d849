"""The engine's two halves of a prefill/decode hand-off, without HTTP: a prefill-only request, and a request that
continues from a prompt another engine prefilled (`LLMEngine.add_prefill`, `LLMEngine.add_prefilled`)."""

from __future__ import annotations

import dataclasses

import pytest
from test_engine import engine_for, run

from tandem.inference.engine.sampling_params import SamplingParams

PROMPT = [(5 * j) % 200 + 3 for j in range(70)]
PARAMS = SamplingParams(max_tokens=12, temperature=1.0, seed=4, ignore_eos=True)


def prefill_on(engine, prompt: list[int], first_block: int = 0):
    engine.add_prefill("p", prompt, first_block)
    outputs = [out for _ in range(10) if engine.has_unfinished for out in engine.step()]
    assert [out.finish_reason for out in outputs] == ["prefilled"] and not engine.has_unfinished
    return outputs[0].prefilled


@pytest.mark.parametrize("overlap", [False, True], ids=["read-each-step", "overlap"])
def test_a_prefilled_request_continues_as_if_this_engine_had_prefilled_it(tiny_dir, overlap):
    """One engine prefills, another continues: the tokens and logprobs of one engine that did both, bit for bit (a
    lone request: every forward of the continuing engine is one the single engine ran too)."""
    prefilled = prefill_on(engine_for(tiny_dir), PROMPT)
    assert prefilled.kv_blocks.shape[2] == 5 and prefilled.logits.shape == (260,)  # 70 tokens in blocks of 16; the vocabulary
    colocated, decode = engine_for(tiny_dir, overlap), engine_for(tiny_dir, overlap)
    colocated.add_request("r", PROMPT, PARAMS)
    decode.add_prefilled("r", PROMPT, PARAMS, 1, True, prefilled)
    assert run(decode) == run(colocated)
    assert (decode.num_prefilled_taken, decode.num_prefilled_refused) == (1, 0)
    assert decode.num_prompt_tokens == colocated.num_prompt_tokens
    assert decode.block_manager.num_free_blocks == decode.block_manager.num_blocks


def test_blocks_the_decode_engine_holds_are_not_sent_and_must_still_be_there(tiny_dir):
    prefill, decode = engine_for(tiny_dir), engine_for(tiny_dir)
    decode.add_request("first", PROMPT[:40], PARAMS)  # caches the prompt's first two full blocks
    run(decode)
    held = decode.block_manager.num_cached_blocks(PROMPT)
    assert held == 2
    prefilled = prefill_on(prefill, PROMPT, first_block=held)
    assert prefilled.kv_blocks.shape[2] == 3
    decode.add_prefilled("r", PROMPT, PARAMS, 2, True, prefilled)
    assert len(run(decode)) == 2 and decode.num_prefilled_taken == 1
    # Blocks said to be held that are not: the prompt is computed here, as if nothing had been handed.
    fresh, colocated = engine_for(tiny_dir), engine_for(tiny_dir)
    fresh.add_prefilled("r", PROMPT, PARAMS, 1, True, prefilled)
    colocated.add_request("r", PROMPT, PARAMS)
    assert run(fresh) == run(colocated) and (fresh.num_prefilled_taken, fresh.num_prefilled_refused) == (0, 1)


def test_a_prefill_on_other_weights_or_of_another_shape_is_computed_here(tiny_dir):
    prefilled = prefill_on(engine_for(tiny_dir), PROMPT)
    colocated = engine_for(tiny_dir)
    colocated.add_request("r", PROMPT, PARAMS)
    want = run(colocated)
    halved = dataclasses.replace(prefilled, kv_blocks=prefilled.kv_blocks[:, :1])  # one layer of two
    later = dataclasses.replace(prefilled, weight_version=1)
    for handed in (halved, later):
        decode = engine_for(tiny_dir)
        decode.add_prefilled("r", PROMPT, PARAMS, 1, True, handed)
        assert run(decode) == want and (decode.num_prefilled_taken, decode.num_prefilled_refused) == (0, 1)
        assert decode.block_manager.num_free_blocks == decode.block_manager.num_blocks


def test_a_prefilled_request_waits_for_room_and_goes_before_the_waiting_prompts(tiny_dir):
    prefilled = prefill_on(engine_for(tiny_dir), PROMPT)
    decode = engine_for(tiny_dir, max_num_seqs=1)
    decode.add_request("busy", PROMPT[:20], dataclasses.replace(PARAMS, max_tokens=3))
    decode.step()  # the batch is full
    decode.add_request("waiting", PROMPT[:30], PARAMS)
    decode.add_prefilled("r", PROMPT, PARAMS, 1, True, prefilled)
    finished = []
    while decode.has_unfinished:
        finished += [out.request_id for out in decode.step() if out.finish_reason is not None]
    assert finished == ["busy", "r", "waiting"] and decode.num_prefilled_taken == 1


def test_a_prefilled_request_aborted_before_its_first_token_gives_its_blocks_back(tiny_dir):
    prefilled = prefill_on(engine_for(tiny_dir), PROMPT)
    for admitted in (False, True):
        decode = engine_for(tiny_dir)
        decode.add_prefilled("r", PROMPT, PARAMS, 1, True, prefilled)
        if admitted:
            decode._admit_prefilled()
            assert decode.scheduler.running
        decode.abort_request("r")
        assert run(decode) == {} and not decode.has_unfinished
        assert decode.block_manager.num_free_blocks == decode.block_manager.num_blocks
