from tandem.orchestrator.hermes import ParsedToolCall, parse_tool_calls


def test_blocks_become_calls_and_leave_the_rest_of_the_text():
    text = 'Let me look.\n<tool_call>\n{"name": "lookup", "arguments": {"q": "x", "n": 2}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me look."
    assert calls == [ParsedToolCall("lookup", '{"q": "x", "n": 2}')]


def test_several_calls_keep_their_order_and_string_arguments_stay_as_written():
    text = '<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call><tool_call>{"name": "b"}</tool_call>'
    _, calls = parse_tool_calls(text)
    assert calls == [ParsedToolCall("a", '{"x": 1}'), ParsedToolCall("b", "{}")]


def test_malformed_blocks_stay_in_the_text():
    for text in ['<tool_call>{"name": "a", </tool_call>', '<tool_call>[1, 2]</tool_call>',
                 '<tool_call>{"arguments": {}}</tool_call>', "no tools here", ""]:
        assert parse_tool_calls(text) == (text, [])
