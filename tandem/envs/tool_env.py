"""Tool use: the model calls Python functions until it answers without a tool call.

Invariant: a tool call never ends the rollout with an exception. Unknown tools, arguments
that are not a JSON object, and tools that raise all come back to the model as an
`Error: ...` tool message, so it can correct itself.
"""

import json
from collections.abc import Callable
from typing import Any

from tandem.envs.callables import maybe_await
from tandem.envs.multi_turn import MultiTurnEnv
from tandem.envs.tool_schema import tool_schema
from tandem.envs.types import Messages, State


class ToolEnv(MultiTurnEnv):
    def __init__(
        self, tools: list[Callable[..., Any]] | None = None, max_turns: int = 10, **kwargs: Any
    ):
        super().__init__(max_turns=max_turns, **kwargs)
        self.tools = list(tools or [])
        self.tool_map = {tool.__name__: tool for tool in self.tools}
        if len(self.tool_map) != len(self.tools):
            raise ValueError(f"tool names must be unique, got {[t.__name__ for t in self.tools]}")
        self.oai_tools = [tool_schema(tool) for tool in self.tools]

    def is_completed(self, messages: Messages, state: State, **kwargs: Any) -> bool:
        last = messages[-1]
        return last["role"] == "assistant" and not last.get("tool_calls")

    async def env_response(
        self, messages: Messages, state: State, **kwargs: Any
    ) -> tuple[Messages, State]:
        replies = []
        for call in messages[-1].get("tool_calls", []):
            result = await self.call_tool(call["function"]["name"], call["function"]["arguments"])
            replies.append({"role": "tool", "content": result, "tool_call_id": call["id"]})
        return replies, state

    async def call_tool(self, name: str, arguments: str) -> str:
        """The tool's result as text, or an `Error: ...` line the model can read."""
        tool = self.tool_map.get(name)
        if tool is None:
            return f"Error: unknown tool {name!r}; available tools: {sorted(self.tool_map)}"
        try:
            kwargs = json.loads(arguments or "{}")
        except json.JSONDecodeError as error:
            return f"Error: arguments for {name!r} are not valid JSON ({error})"
        if not isinstance(kwargs, dict):
            return f"Error: arguments for {name!r} must be a JSON object, got {arguments!r}"
        try:
            return str(await maybe_await(tool(**kwargs)))
        except Exception as error:  # the model's mistake, reported back to it
            return f"Error: {name} raised {type(error).__name__}: {error}"
