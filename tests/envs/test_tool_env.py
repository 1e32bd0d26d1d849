import asyncio
from typing import Literal

import pytest

from tandem.envs import StopReason, ToolEnv, tool_schema

PROMPT = [{"role": "user", "content": "what is 2 + 3?"}]


def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Longer notes that are not part of the description.

    Args:
        a: The first number.
        b (int): The second number,
            zero by default.
    """
    return a + b


async def lookup(
    key: str, mode: Literal["fast", "exact"] | None = None, tags: list[str] | None = None
):
    """Look a key up."""
    return {"key": key, "mode": mode}


def explode(reason: str) -> str:
    """Always fails."""
    raise RuntimeError(reason)


def test_schema_from_signature_and_docstring():
    assert tool_schema(add) == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "The first number."},
                    "b": {"type": "integer", "description": "The second number, zero by default."},
                },
                "required": ["a"],
            },
        },
    }
    properties = tool_schema(lookup)["function"]["parameters"]["properties"]
    assert properties == {
        "key": {"type": "string"},
        "mode": {"enum": ["fast", "exact"]},
        "tags": {"type": "array", "items": {"type": "string"}},
    }


def test_unsupported_annotation_is_named():
    def bad(x: complex) -> str:
        return str(x)

    with pytest.raises(TypeError, match="tool 'bad', parameter 'x'"):
        tool_schema(bad)


def test_tool_rollout_runs_calls_and_reports_errors_to_the_model(scripted_client):
    env = ToolEnv(tools=[add, lookup, explode], max_turns=5)
    client = scripted_client(
        [
            {"tool_calls": [("c1", "add", {"a": 2, "b": 3}), ("c2", "lookup", {"key": "k"})]},
            {"tool_calls": [("c3", "explode", {"reason": "boom"}), ("c4", "add", "{not json")]},
            {"tool_calls": [("c5", "add", "[1, 2]"), ("c6", "nope", "{}"), ("c7", "add", {})]},
            "The answer is 5.",
        ]
    )
    completion, state = asyncio.run(env.rollout(client, "m", PROMPT))
    assert state["stop_reason"] == StopReason.COMPLETED
    assert state["turn"] == 4
    tool_messages = [m for m in completion if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tool_messages] == ["c1", "c2", "c3", "c4", "c5", "c6", "c7"]
    results = [m["content"] for m in tool_messages]
    assert results[0] == "5"
    assert results[1] == "{'key': 'k', 'mode': None}"
    assert results[2] == "Error: explode raised RuntimeError: boom"
    assert results[3].startswith("Error: arguments for 'add' are not valid JSON")
    assert results[4] == "Error: arguments for 'add' must be a JSON object, got '[1, 2]'"
    assert results[5] == "Error: unknown tool 'nope'; available tools: ['add', 'explode', 'lookup']"
    assert results[6].startswith("Error: add raised TypeError")
    assert completion[0]["tool_calls"][0] == {
        "id": "c1",
        "type": "function",
        "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
    }
    assert completion[-1] == {"role": "assistant", "content": "The answer is 5."}
    assert all(call["tools"] == env.oai_tools for call in client.calls)
    assert [t["function"]["name"] for t in env.oai_tools] == ["add", "lookup", "explode"]


def test_tool_rollout_stops_at_max_turns(scripted_client):
    env = ToolEnv(tools=[add], max_turns=2)
    call = {"tool_calls": [("c", "add", {"a": 1})]}
    completion, state = asyncio.run(env.rollout(scripted_client([call, call]), "m", PROMPT))
    assert state["stop_reason"] == StopReason.MAX_TURNS
    assert [m["role"] for m in completion] == ["assistant", "tool", "assistant"]


def test_duplicate_tool_names_are_refused():
    with pytest.raises(ValueError, match="unique"):
        ToolEnv(tools=[add, add])
