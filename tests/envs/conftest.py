"""A scripted stand-in for an OpenAI-shaped async client.

Each call to `client.chat.completions.create` takes the next scripted reply and returns an
object shaped like an OpenAI chat completion, plus an extra `token_ids` field (as the
orchestrator's client adds) so tests can check that raw responses are passed through.

A reply is a string (the content) or a dict with optional `content`, `finish_reason` and
`tool_calls`: a list of (call id, tool name, arguments), arguments being a dict to
JSON-encode or a raw string.
"""

import asyncio
import json
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tandem.envs.sandbox import SandboxLimits, run_python_sandboxed


class ScriptedClient:
    def __init__(self, replies: list[str | dict[str, Any]]):
        self.replies = [{"content": r} if isinstance(r, str) else r for r in replies]
        self.calls: list[dict[str, Any]] = []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._create))

    async def _create(self, **kwargs: Any) -> SimpleNamespace:
        self.calls.append(kwargs)
        reply = self.replies[len(self.calls) - 1]
        tool_calls = [
            SimpleNamespace(
                id=call_id,
                type="function",
                function=SimpleNamespace(
                    name=name, arguments=args if isinstance(args, str) else json.dumps(args)
                ),
            )
            for call_id, name, args in reply.get("tool_calls", [])
        ]
        message = SimpleNamespace(
            role="assistant", content=reply.get("content", ""), tool_calls=tool_calls or None
        )
        choice = SimpleNamespace(message=message, finish_reason=reply.get("finish_reason", "stop"))
        return SimpleNamespace(choices=[choice], token_ids=[len(self.calls)])


@pytest.fixture
def scripted_client():
    """`scripted_client(replies)` builds a client that answers with `replies` in order."""
    return ScriptedClient


@pytest.fixture(scope="session")
def byte_tokenizer():
    """The tiny preset's tokenizer (bytes + ChatML, Hermes tool calls), built without a model."""
    from tandem.models.byte_tokenizer import build_byte_tokenizer

    return build_byte_tokenizer()


@pytest.fixture(scope="module")
def confined():
    """Skip tests that need the root-only confinement (own uid, process limit, namespaces)."""
    with tempfile.TemporaryDirectory() as workdir:
        result = asyncio.run(run_python_sandboxed(["-c", "pass"], Path(workdir), SandboxLimits()))
    if not all(result.enforced.values()):
        pytest.skip(f"the sandbox is not fully confined here: {result.enforced}")
