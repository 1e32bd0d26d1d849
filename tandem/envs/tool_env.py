"""Tool use: the model calls Python functions until it answers without a tool call.

Invariant: a tool call never ends the rollout with an exception. Unknown tools, arguments
that are not a JSON object, tools that raise (`sys.exit` included) and tools that run past
`tool_timeout_s` all come
back to the model as an `Error: ...` tool message, so it can correct itself; each such error is
also appended to `state["tool_errors"]` and counted in the `num_tool_errors` metric.

Sync tools run in a daemon thread of their own, so a slow one never blocks the event loop (and
the other rollouts on it). Python cannot stop a thread: a sync tool that never returns is
abandoned after its timeout and keeps its thread until the process ends. Tools that may run
untrusted work (code, shell) should run it in a subprocess they can kill, as `code_fix` does.
"""

import asyncio
import inspect
import json
import threading
from collections.abc import Callable, Sequence
from typing import Any

from tandem.envs.callables import maybe_await
from tandem.envs.multi_turn import MultiTurnEnv
from tandem.envs.rubric import Rubric, RubricGroup
from tandem.envs.tool_schema import tool_schema
from tandem.envs.types import ChatMessage, Messages, State

# What a Hermes-style call the client could not parse leaves in the text (see `num_tool_errors`).
UNPARSED_CALL_MARK = "<tool_call>"


class ToolEnv(MultiTurnEnv):
    """`state_args` name tool parameters the environment fills from the rollout's state (see
    `update_tool_args`); they are left out of the schemas, and a model that passes one is told
    it is not an argument it may set."""

    def __init__(
        self,
        tools: list[Callable[..., Any]] | None = None,
        max_turns: int = 10,
        tool_timeout_s: float = 30.0,
        state_args: Sequence[str] = (),
        **kwargs: Any,
    ):
        super().__init__(max_turns=max_turns, **kwargs)
        if tool_timeout_s <= 0:
            raise ValueError(f"tool_timeout_s must be > 0, got {tool_timeout_s}")
        self.tools = list(tools or [])
        self.tool_map = {tool.__name__: tool for tool in self.tools}
        if len(self.tool_map) != len(self.tools):
            raise ValueError(f"tool names must be unique, got {[t.__name__ for t in self.tools]}")
        self.tool_timeout_s = tool_timeout_s
        self.state_args = frozenset(state_args)
        self.oai_tools = [tool_schema(tool, hidden=self.state_args) for tool in self.tools]
        tool_metrics = Rubric(funcs=[num_tool_calls, num_tool_errors], weights=[0.0, 0.0])
        self.rubric = RubricGroup([self.rubric, tool_metrics])

    def setup_state(self, state: State, **kwargs: Any) -> State:
        state["tool_calls"] = 0
        state["tool_errors"] = []
        return state

    def update_tool_args(self, name: str, args: dict[str, Any], state: State) -> dict[str, Any]:
        """The arguments a tool is called with: the model's, plus the `state_args` a subclass
        takes from `state` (e.g. the rollout's own working directory)."""
        return args

    def is_completed(self, messages: Messages, state: State, **kwargs: Any) -> bool:
        last = messages[-1]
        return last["role"] == "assistant" and not last.get("tool_calls")

    async def env_response(
        self, messages: Messages, state: State, **kwargs: Any
    ) -> tuple[Messages, State]:
        replies = []
        for call in messages[-1].get("tool_calls", []):
            name, arguments = call["function"]["name"], call["function"]["arguments"]
            result, error = await self.call_tool(name, arguments, state)
            state["tool_calls"] += 1
            if error is not None:
                state["tool_errors"].append(f"{name}: {error}")
            replies.append({"role": "tool", "content": result, "tool_call_id": call["id"]})
        return replies, state

    async def call_tool(self, name: str, arguments: str | dict, state: State) -> tuple[str, str | None]:
        """(the text the model reads, the error or None). On error the text is `Error: ...`."""
        tool = self.tool_map.get(name)
        if tool is None:
            return _error(f"unknown tool {name!r}; available tools: {sorted(self.tool_map)}")
        try:  # clients other than ours may hand over the arguments already decoded
            kwargs = arguments if isinstance(arguments, dict) else json.loads(arguments or "{}")
        except (json.JSONDecodeError, TypeError) as error:
            return _error(f"arguments for {name!r} are not valid JSON ({error})")
        if not isinstance(kwargs, dict):
            return _error(f"arguments for {name!r} must be a JSON object, got {arguments!r}")
        reserved = sorted(self.state_args & set(kwargs))
        if reserved:
            return _error(f"{name} got argument(s) {reserved} that the environment sets, not the model")
        kwargs = self.update_tool_args(name, kwargs, state)
        try:
            return str(await asyncio.wait_for(_invoke(tool, kwargs), self.tool_timeout_s)), None
        except TimeoutError:
            return _error(f"{name} did not finish within {self.tool_timeout_s:g} s")
        except Exception as error:  # the model's mistake, reported back to it
            return _error(f"{name} raised {type(error).__name__}: {error}")


def _error(message: str) -> tuple[str, str]:
    return f"Error: {message}", message


class ToolExited(Exception):
    """A tool called `sys.exit`. Reported as this error: a SystemExit reaching the event loop
    would stop it, and with it the run."""


async def _invoke(tool: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    """Await an async tool on the loop; run a sync one in a daemon thread of its own."""
    if inspect.iscoroutinefunction(tool):
        try:
            return await tool(**kwargs)
        except SystemExit as error:
            raise ToolExited(f"SystemExit: {error}") from None
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def work() -> None:
        try:
            outcome = (future.set_result, tool(**kwargs))
        except SystemExit as error:
            outcome = (future.set_exception, ToolExited(f"SystemExit: {error}"))
        except BaseException as error:
            outcome = (future.set_exception, error)
        try:
            loop.call_soon_threadsafe(_settle, future, *outcome)
        except RuntimeError:
            pass  # the loop closed while the tool ran: nobody is waiting for it

    threading.Thread(target=work, name=f"tool-{tool.__name__}", daemon=True).start()
    return await maybe_await(await future)


def _settle(future: asyncio.Future, setter: Callable[[Any], None], value: Any) -> None:
    if not future.done():  # the caller may have given up (timeout) already
        setter(value)


def num_tool_calls(state: State) -> float:
    """Tool calls the environment ran (errors included)."""
    return float(state.get("tool_calls", 0))


def num_tool_errors(state: State, completion: Messages) -> float:
    """Failed tool calls, plus assistant turns with a `<tool_call>` block the client could not
    parse (bad JSON there reaches no tool: the turn counts as the model's answer)."""
    unparsed = sum(
        1
        for message in completion
        if message.get("role") == "assistant"
        and not message.get("tool_calls")
        and UNPARSED_CALL_MARK in (message.get("content") or "")
    )
    return float(len(state.get("tool_errors", [])) + unparsed)


def demo_tool_turn(call_id: str, name: str, arguments: dict[str, Any], reply: str) -> list[ChatMessage]:
    """An assistant turn calling tool `name` and the tool's reply, shaped as a rollout records
    them: the building block of tool-use SFT demonstrations."""
    function = {"name": name, "arguments": json.dumps(arguments)}
    call = {"id": call_id, "type": "function", "function": function}
    return [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": reply, "tool_call_id": call_id},
    ]
