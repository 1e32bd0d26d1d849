import asyncio
import sys
import time
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


def sleepy(seconds: float) -> str:
    """Sleeps (a sync tool that hangs)."""
    time.sleep(seconds)
    return "woke up"


async def async_sleepy(seconds: float) -> str:
    """Sleeps on the event loop (an async tool that hangs)."""
    await asyncio.sleep(seconds)
    return "woke up"


def quit_process(code: int) -> str:
    """Calls sys.exit."""
    sys.exit(code)


async def async_quit() -> str:
    """Calls sys.exit on the event loop."""
    sys.exit(4)


def test_bad_calls_are_recorded_scored_and_never_end_the_run(scripted_client):
    env = ToolEnv(tools=[add, explode, sleepy, async_sleepy, quit_process, async_quit], tool_timeout_s=0.2, max_turns=5)
    client = scripted_client(
        [
            {"tool_calls": [("c1", "add", "{bad"), ("c2", "nope", "{}"), ("c3", "explode", {"reason": "x"})]},
            {"tool_calls": [("c4", "sleepy", {"seconds": 30}), ("c5", "async_sleepy", {"seconds": 30})]},
            {"tool_calls": [("c6", "sleepy", {"seconds": 0}), ("c7", "add", {"a": 1, "b": 1}), ("c8", "quit_process", {"code": 3}), ("c9", "async_quit", {})]},
            # a call the client could not parse stays in the text and ends the episode as the answer
            '<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>',
        ]
    )
    start = time.monotonic()
    rollout = asyncio.run(env.run_rollout(client, "m", env_example()))
    assert time.monotonic() - start < 5  # the hanging tools were abandoned after 0.2 s each
    state, score = rollout.state, rollout.score
    results = [m["content"] for m in rollout.completion if m["role"] == "tool"]
    assert results[3] == results[4].replace("async_sleepy", "sleepy") == "Error: sleepy did not finish within 0.2 s"
    assert results[5:] == ["woke up", "2", "Error: quit_process raised ToolExited: SystemExit: 3",
                           "Error: async_quit raised ToolExited: SystemExit: 4"]
    assert state["tool_calls"] == 9
    assert [e.split(":")[0] for e in state["tool_errors"]] == [
        "add", "nope", "explode", "sleepy", "async_sleepy", "quit_process", "async_quit"]
    assert score.metrics == {"num_tool_calls": 9.0, "num_tool_errors": 8.0}
    assert score.reward == 0.0 and score.errors == []
    assert state["stop_reason"] == StopReason.COMPLETED


def env_example():
    return {"prompt": PROMPT, "answer": "", "task": "t", "info": {}}


def test_state_args_are_hidden_from_the_model_and_filled_by_the_env(scripted_client):
    def whoami(greeting: str, rollout_id: str) -> str:
        """Greets from the rollout."""
        return f"{greeting} from {rollout_id}"

    class StatefulEnv(ToolEnv):
        def setup_state(self, state, **kwargs):
            state = super().setup_state(state)
            state["rollout_id"] = "r7"
            return state

        def update_tool_args(self, name, args, state):
            return {**args, "rollout_id": state["rollout_id"]}

    env = StatefulEnv(tools=[whoami], state_args=["rollout_id"])
    assert env.oai_tools[0]["function"]["parameters"]["properties"] == {"greeting": {"type": "string"}}
    client = scripted_client(
        [{"tool_calls": [("c1", "whoami", {"greeting": "hi"}), ("c2", "whoami", {"greeting": "x", "rollout_id": "r0"})]}, "done"]
    )
    completion, state = asyncio.run(env.rollout(client, "m", PROMPT))
    assert completion[1]["content"] == "hi from r7"
    assert completion[2]["content"] == "Error: whoami got argument(s) ['rollout_id'] that the environment sets, not the model"
    assert len(state["tool_errors"]) == 1


def test_arguments_already_decoded_are_accepted():
    env = ToolEnv(tools=[add])
    assert asyncio.run(env.call_tool("add", {"a": 2, "b": 5}, {})) == ("7", None)
    text, error = asyncio.run(env.call_tool("add", 12, {}))
    assert text.startswith("Error: arguments for 'add' are not valid JSON") and error is not None
