"""The server's tool calls (OpenAI-shaped, with ids), and the incremental detokenizer."""

import json

from tandem.inference.chat import parse_tool_calls
from tandem.inference.engine.detokenizer import IncrementalDetokenizer, text_decoder
from tandem.models.byte_tokenizer import build_byte_tokenizer


def test_hermes_tool_calls_become_openai_tool_calls():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert [(c["type"], c["function"]["name"]) for c in calls] == [("function", "get_weather"), ("function", "get_time")]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert calls[0]["id"].startswith("call_") and calls[0]["id"] != calls[1]["id"]


def test_text_without_valid_calls_stays_content():
    for text in ("plain answer", "<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>'):
        assert parse_tool_calls(text) == (text, [])
    assert parse_tool_calls('<tool_call>{"name": "f"}</tool_call>')[0] is None


def test_incremental_text_equals_the_full_decode_across_split_characters():
    tokenizer = build_byte_tokenizer()
    ids = list("héllo → wörld 🙂".encode()) + [258]
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    pieces = [detok.push(ids[:i + 1]) for i in range(len(ids))]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + detok.flush(ids) == "héllo → wörld 🙂"
    # Ids without text (past the vocabulary: a model's padded rows) between every byte, inside characters too: the
    # window grows over them, from a start whose text is kept, and the text is the same.
    padded = [t for token in ids for t in (token, 300, 301)]
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    pieces = [detok.push(padded[:i + 1]) for i in range(len(padded))]
    assert "".join(pieces) + detok.flush(padded) == "héllo → wörld 🙂"


def test_the_detokenizers_decode_is_the_tokenizers():
    """The Rust tokenizer's decode, where the detokenizer calls it directly, gives `decode`'s text: bytes, special
    tokens (kept or skipped) and ids past the vocabulary (a model's padded rows) alike."""
    tokenizer = build_byte_tokenizer()
    ids = list(range(tokenizer.vocab_size + 4)) * 2
    for skip in (True, False):
        decode = text_decoder(tokenizer, skip)
        assert decode.func == tokenizer.backend_tokenizer.decode  # the direct path, which the rest checks
        for window in (ids[:1], ids[250:262], ids, ids[::-7]):
            assert decode(window) == tokenizer.decode(window, skip_special_tokens=skip)
