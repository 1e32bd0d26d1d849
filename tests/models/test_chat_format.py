"""The chat format shared by server and orchestrator: Hermes tool calls out of a completion, prompts in."""

import pytest

from tandem.inference.chat import parse_tool_calls as server_parse
from tandem.models.byte_tokenizer import build_byte_tokenizer
from tandem.models.chat import NoChatTemplate, ParsedToolCall, parse_tool_calls, render_chat, streamable_content


def test_blocks_become_calls_and_leave_the_rest_of_the_text():
    text = 'Let me look.\n<tool_call>\n{"name": "lookup", "arguments": {"q": "x", "n": 2}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me look."
    assert calls == [ParsedToolCall("lookup", '{"q": "x", "n": 2}')]


def test_text_after_a_call_is_kept():
    text = 'Let me check. <tool_call>{"name": "lookup", "arguments": {}}</tool_call> Then I answer 42.'
    assert parse_tool_calls(text) == ("Let me check. Then I answer 42.", [ParsedToolCall("lookup", "{}")])


def test_the_content_extends_what_a_stream_sent_before_the_first_call():
    text = ' Sure. <tool_call>{"name": "f"}</tool_call>\nDone.'
    content, _ = parse_tool_calls(text)
    assert content == " Sure. Done." and content.startswith(streamable_content(text))


def test_server_and_orchestrator_read_a_completion_alike():
    text = 'A <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>\nB <tool_call>{"name": "g"}</tool_call>'
    content, calls = parse_tool_calls(text)
    server_content, server_calls = server_parse(text)
    assert server_content == content == "A B"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in server_calls] == [(c.name, c.arguments) for c in calls]


def test_several_calls_keep_their_order_and_string_arguments_stay_as_written():
    text = '<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call><tool_call>{"name": "b"}</tool_call>'
    _, calls = parse_tool_calls(text)
    assert calls == [ParsedToolCall("a", '{"x": 1}'), ParsedToolCall("b", "{}")]


def test_malformed_blocks_stay_in_the_text():
    for text in ['<tool_call>{"name": "a", </tool_call>', '<tool_call>[1, 2]</tool_call>',
                 '<tool_call>{"arguments": {}}</tool_call>', "<tool_call>{not json}</tool_call>", "no tools here", ""]:
        assert parse_tool_calls(text) == (text, [])
    text = 'x <tool_call>{bad}</tool_call> y <tool_call>{"name": "f"}</tool_call>'
    assert parse_tool_calls(text) == ("x <tool_call>{bad}</tool_call> y", [ParsedToolCall("f", "{}")])


def test_streaming_holds_back_what_may_start_a_tool_call():
    assert streamable_content("Sure, <tool_call>{") == "Sure, "
    assert streamable_content("Sure, <tool_c") == "Sure, "
    assert streamable_content("a < b") == "a < b"


def test_render_goes_through_the_template_and_names_a_missing_one():
    tokenizer = build_byte_tokenizer()
    ids = render_chat(tokenizer, [{"role": "user", "content": "hi"}])
    assert tokenizer.decode(ids).endswith("hi<|im_end|>\n<|im_start|>assistant\n")
    tokenizer.chat_template = None
    with pytest.raises(NoChatTemplate, match="no chat template"):
        render_chat(tokenizer, [{"role": "user", "content": "hi"}])
