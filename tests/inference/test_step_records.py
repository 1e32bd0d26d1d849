"""The engine's step records (`engine.num_step_records`): one per step that read tokens or launched a forward, its
time parts adding up to its interval, and the shapes of what it read and launched, a hand-off's joining prompt and
imported KV tokens included; `GET /engine/steps` serves them. Records change no token."""

from __future__ import annotations

import time

import httpx
import pytest
from inference_helpers import make_config
from test_engine import engine_for, run
from test_prefilled import PARAMS, PROMPT, prefill_on

from tandem.inference.server import BackgroundServer


@pytest.mark.parametrize("overlap", [False, True], ids=["read-each-step", "overlap"])
def test_each_step_is_recorded_with_its_parts_and_shape_and_tokens_do_not_change(tiny_dir, overlap):
    recorded, plain = engine_for(tiny_dir, overlap, num_step_records=100), engine_for(tiny_dir, overlap)
    for engine in (recorded, plain):
        engine.add_request("a", PROMPT, PARAMS)
    assert run(recorded) == run(plain)
    records = list(recorded.step_records.records)
    read = [r.read for r in records if r.read is not None]
    # The prompt's step samples the first token, then one step per further token.
    assert [(s.num_seqs, s.num_tokens, s.num_prefill_tokens) for s in read] == (
        [(1, len(PROMPT), len(PROMPT))] + [(1, 1, 0)] * (PARAMS.max_tokens - 1))
    assert all(not s.graph and s.num_joined == 0 and s.num_imported_tokens == 0 for s in read)
    for record in records:
        assert record.between_s + record.host_s + record.wait_s == pytest.approx(record.interval_s, abs=1e-9)
        assert 0 <= record.admit_s <= record.host_s and record.cpu_s >= 0 and record.gc_s >= 0
        assert record.num_blocked >= 0
        if record.launched is not None:  # the CPU computes a step within the call that launches it
            busy_from, busy_to = record.launched.busy
            assert record.end - record.interval_s <= busy_from <= busy_to == record.end
    assert [b.end > a.end for a, b in zip(records, records[1:])] == [True] * (len(records) - 1)
    if overlap:  # each step is read by the call after the one that launched it
        assert all(later.read is earlier.launched for earlier, later in zip(records, records[1:]))


def test_a_step_in_which_the_engine_thread_blocks_counts_it(tiny_dir):
    """`num_blocked` counts the thread's blocking waits (a sleep here; a server's: the interpreter lock)."""
    engine = engine_for(tiny_dir, num_step_records=100)
    forward = engine.runner.run

    def sleeping_forward(*args, **kwargs):
        time.sleep(0.001)
        return forward(*args, **kwargs)

    engine.runner.run = sleeping_forward
    engine.add_request("a", PROMPT, PARAMS)
    run(engine)
    launched = [r for r in engine.step_records.records if r.launched is not None]
    assert len(launched) == PARAMS.max_tokens and all(r.num_blocked >= 1 for r in launched)


def test_a_handed_over_prompt_is_recorded_joining_with_its_imported_tokens(tiny_dir):
    prefill = engine_for(tiny_dir, num_step_records=10)
    prefilled = prefill_on(prefill, PROMPT)
    # The prefill engine's forward sampled nothing: recorded as launched, with its prompt tokens.
    (record,) = prefill.step_records.records
    assert record.read is None and (record.launched.num_seqs, record.launched.num_prefill_tokens) == (0, len(PROMPT))
    decode = engine_for(tiny_dir, num_step_records=100)
    decode.add_request("decoding", [7] * 20, PARAMS)  # shares no block with the handed prompt
    run(decode, max_steps=3)
    decode.add_prefilled("handed", PROMPT, PARAMS, 1, True, prefilled)
    run(decode)
    shapes = [r.read for r in decode.step_records.records]
    joined = [s for s in shapes if s.num_joined]
    assert len(joined) == 1 and joined[0].num_imported_tokens == len(PROMPT) and joined[0].num_seqs == 2
    assert joined[0].num_tokens == 1  # the decoding sequence's token: the handed prompt samples from its logits row
    assert sum(s.num_imported_tokens for s in shapes) == len(PROMPT)


def test_the_records_are_served_where_asked_and_refused_naming_the_key_elsewhere(tiny_dir):
    server = BackgroundServer(make_config(tiny_dir, num_step_records=4))
    plain = BackgroundServer(make_config(tiny_dir))
    try:
        for url in (server.url, plain.url):
            response = httpx.post(f"{url}/v1/generate", json={"prompt_token_ids": PROMPT, "max_tokens": 6}, timeout=60)
            assert response.status_code == 200, response.text
        steps = httpx.get(f"{server.url}/engine/steps").json()["steps"]
        assert len(steps) == 4  # the last four of the request's six steps
        assert [s["read"]["num_seqs"] for s in steps] == [1] * 4 and steps[-1]["read"]["num_prefill_tokens"] == 0
        assert set(steps[0]) >= {"interval_s", "between_s", "host_s", "admit_s", "wait_s", "cpu_s", "gc_s",
                                 "num_blocked", "launched"}
        refused = httpx.get(f"{plain.url}/engine/steps")
        assert refused.status_code == 404 and "engine.num_step_records" in refused.json()["error"]["message"]
    finally:
        server.stop()
        plain.stop()
