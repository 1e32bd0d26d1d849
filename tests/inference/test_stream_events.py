"""A streamed chunk's event is byte for byte `data: json.dumps(chunk)`: the encoder that writes the repeated fields
once and a completion's choice from its parts changes no byte of the wire format."""

from __future__ import annotations

import json
import math
import random

import httpx
import pytest

from tandem.inference.stream_events import ChunkEvents, completion_choice, sse

TEXTS = ["", "hello", ' said "hi"\\', "é中文🙂", "\x00\x1f\n\t\r\x7f", "\ud800 lone surrogate", "</script>\u2028\u2029"]
REASONS = [None, "stop", "length", "abort"]


def meta(rng: random.Random) -> dict:
    return {"id": f"cmpl-{rng.getrandbits(128):032x}", "created": rng.randrange(2**31),
            "model": rng.choice(["/tmp/models/tiny", 'odd "name" é', "m"])}


def logprob(rng: random.Random) -> float:
    return rng.choice([-math.inf, math.inf, math.nan, 0.0, -0.0, -1e-300, -123.456789, rng.uniform(-30, 0)])


def legacy_logprobs(rng: random.Random, ids: list[int], with_top: bool) -> dict:
    tokens = [rng.choice(TEXTS) for _ in ids]
    top = [{rng.choice(TEXTS): logprob(rng) for _ in range(rng.randrange(3))} for _ in ids] if with_top else None
    return {"tokens": tokens, "token_logprobs": [logprob(rng) for _ in ids], "top_logprobs": top,
            "text_offset": list(range(len(ids)))}


def test_completion_events_are_json_dumps_of_the_chunk_byte_for_byte():
    rng = random.Random(0)
    for _ in range(2000):
        head = meta(rng)
        ids = [rng.randrange(200_000) for _ in range(rng.choice([0, 1, 1, 1, 5]))]
        prompt = [rng.randrange(200_000) for _ in range(rng.randrange(1, 9))]
        text = "".join(rng.choice(TEXTS) for _ in range(rng.randrange(3)))
        reason, index = rng.choice(REASONS), rng.randrange(16)
        logprobs = rng.choice([None, legacy_logprobs(rng, ids, False), legacy_logprobs(rng, ids, True)])
        with_ids, first = rng.random() < 0.5, rng.random() < 0.3
        version = rng.randrange(-1, 1000)

        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
        if with_ids:
            choice["token_ids"] = ids
            if first:
                choice["prompt_token_ids"] = prompt
        if reason is not None:
            choice["weight_version"] = version
        expected = sse({**head, "object": "text_completion", "choices": [choice]})

        written = ChunkEvents(head, "text_completion").event(completion_choice(
            index, text, logprobs, reason, ids if with_ids else None, prompt if with_ids and first else None,
            version if reason is not None else None))
        assert written == expected


def test_chunk_events_wrap_any_choice_as_json_dumps_does():
    head = {"id": "chatcmpl-1", "created": 7, "model": "m\u00e9"}
    choice = {"index": 1, "delta": {"content": 'a "b"\n'}, "logprobs": {"content": [{"logprob": -math.inf}]},
              "finish_reason": None}
    written = ChunkEvents(head, "chat.completion.chunk").event(json.dumps(choice))
    assert written == sse({**head, "object": "chat.completion.chunk", "choices": [choice]})
    assert "-Infinity" in written and written.endswith("]}\n\n")


@pytest.mark.parametrize("prompt", ["h\u00e9 \"q\"", ["ab", "cde"]], ids=["one-prompt", "two-prompts"])
def test_a_served_stream_writes_each_chunk_as_json_dumps_does(server, tiny_dir, prompt):
    """The server's events, read back and written again by `json.dumps`, are the same bytes, their fields in order."""
    body = {"model": str(tiny_dir), "prompt": prompt, "n": 2, "max_tokens": 6, "ignore_eos": True, "stream": True,
            "return_token_ids": True, "logprobs": 2, "seed": 1, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as stream:
        lines = [line for line in stream.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert [sse(chunk) for chunk in chunks] == [line + "\n\n" for line in lines[:-1]]
    assert all(list(chunk)[:5] == ["id", "created", "model", "object", "choices"] for chunk in chunks)
    choices = [c for chunk in chunks for c in chunk["choices"]]
    assert len(choices) == 6 * len(prompt if isinstance(prompt, list) else [prompt]) * 2
    assert all(list(c)[:5] == ["index", "text", "logprobs", "finish_reason", "token_ids"] for c in choices)
