"""The rollout loop against a real `openai.AsyncOpenAI`, served by an in-process mock
transport that answers like vLLM (extra token-id fields included)."""

import asyncio
import json

import httpx
import pytest

from tandem.envs import ToolEnv

openai = pytest.importorskip("openai")


def completion_body(message: dict, finish_reason: str, turn: int) -> dict:
    return {
        "id": f"chatcmpl-{turn}",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "prompt_token_ids": [1, 2, 3],
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", **message},
                "finish_reason": finish_reason,
                "token_ids": [10 + turn],
            }
        ],
    }


def test_tool_rollout_through_the_openai_client():
    requests = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        requests.append(body)
        if len(requests) == 1:
            call = {
                "id": "c1",
                "type": "function",
                "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
            }
            reply = completion_body({"content": None, "tool_calls": [call]}, "tool_calls", 1)
        else:
            reply = completion_body({"content": "5"}, "stop", 2)
        return httpx.Response(200, json=reply)

    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    async def run():
        http_client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        client = openai.AsyncOpenAI(base_url="http://mock/v1", api_key="x", http_client=http_client)
        env = ToolEnv(tools=[add], sampling_args={"extra_body": {"return_token_ids": True}})
        prompt = [{"role": "user", "content": "2 + 3?"}]
        return await env.rollout(client, "m", prompt, sampling_args={"max_tokens": 16})

    completion, state = asyncio.run(run())
    assert state["stop_reason"] == "completed" and state["turn"] == 2
    assert [m["role"] for m in completion] == ["assistant", "tool", "assistant"]
    assert completion[1] == {"role": "tool", "content": "5", "tool_call_id": "c1"}
    assert requests[0]["tools"][0]["function"]["name"] == "add"
    assert requests[0]["return_token_ids"] is True and requests[0]["max_tokens"] == 16
    assert requests[1]["messages"][-1] == completion[1]
    first = state["responses"][0]
    assert first.prompt_token_ids == [1, 2, 3]
    assert [r.choices[0].token_ids for r in state["responses"]] == [[11], [12]]
