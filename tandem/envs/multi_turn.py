"""The multi-turn rollout loop: model turn, environment turn, repeat.

Loop contract (what the orchestrator relies on):
- each model call is `await client.chat.completions.create(model=..., messages=...,
  [tools=...], **sampling_args)`; its raw response is appended to `state["responses"]`
  untouched, so fields the client adds (token ids, logprobs, policy version) survive;
- the assistant message of turn i is built from `responses[i].choices[0].message`;
- `state["completion"]` is every message after the prompt, in order: assistant turns and the
  environment's replies;
- the loop stops, recording `state["stop_reason"]`, when `is_completed` is True (checked before
  each model call and after each answer), when the answer was cut (`finish_reason ==
  "length"`), or after `max_turns` model calls. `env_response` is never called after the
  last model turn.

Hooks (`setup_state`, `is_completed`, `env_response`) may be sync or async.
"""

import copy
from abc import abstractmethod
from collections.abc import Awaitable
from typing import Any

from tandem.envs.callables import maybe_await
from tandem.envs.environment import Environment
from tandem.envs.types import ChatMessage, Info, Messages, State, StopReason


def assistant_message(response: Any) -> ChatMessage:
    """The chat message of an OpenAI-shaped response's first choice, as a plain dict."""
    message = response.choices[0].message
    result: ChatMessage = {"role": "assistant", "content": message.content or ""}
    tool_calls = getattr(message, "tool_calls", None)
    if tool_calls:
        result["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": call.function.arguments},
            }
            for call in tool_calls
        ]
    return result


class MultiTurnEnv(Environment):
    """Subclasses say when the episode is over (`is_completed`) and what the environment
    answers in between (`env_response`)."""

    def __init__(self, max_turns: int = 10, **kwargs: Any):
        super().__init__(**kwargs)
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.max_turns = max_turns

    def setup_state(self, state: State, **kwargs: Any) -> State | Awaitable[State]:
        """Add environment-specific keys to a fresh state."""
        return state

    @abstractmethod
    def is_completed(
        self, messages: Messages, state: State, **kwargs: Any
    ) -> bool | Awaitable[bool]:
        """Whether the episode is over, given the whole conversation so far."""

    @abstractmethod
    def env_response(
        self, messages: Messages, state: State, **kwargs: Any
    ) -> tuple[Messages, State] | Awaitable[tuple[Messages, State]]:
        """The environment's reply to the last model turn (user or tool messages)."""

    async def get_model_response(
        self, client: Any, model: str, messages: Messages, sampling_args: dict[str, Any]
    ) -> Any:
        tools = {"tools": self.oai_tools} if self.oai_tools else {}
        # A copy: the conversation keeps growing, and a client may keep what it was sent.
        return await client.chat.completions.create(
            model=model, messages=list(messages), **tools, **sampling_args
        )

    async def rollout(
        self,
        client: Any,
        model: str,
        prompt: Messages,
        answer: str = "",
        task: str = "default",
        info: Info | None = None,
        sampling_args: dict[str, Any] | None = None,
    ) -> tuple[Messages, State]:
        prompt = copy.deepcopy(prompt)
        state: State = {
            "prompt": prompt,
            "completion": [],
            "answer": answer,
            "task": task,
            "info": copy.deepcopy(info or {}),
            "turn": 0,
            "responses": [],
            "stop_reason": None,
        }
        state = await maybe_await(self.setup_state(state))
        args = {**self.sampling_args, **(sampling_args or {})}
        messages = list(prompt)
        while True:
            if await maybe_await(self.is_completed(messages, state)):
                state["stop_reason"] = StopReason.COMPLETED
                break
            response = await self.get_model_response(client, model, messages, args)
            state["responses"].append(response)
            state["turn"] += 1
            reply = assistant_message(response)
            messages.append(reply)
            state["completion"].append(reply)
            if response.choices[0].finish_reason == "length":
                state["stop_reason"] = StopReason.LENGTH
                break
            if await maybe_await(self.is_completed(messages, state)):
                state["stop_reason"] = StopReason.COMPLETED
                break
            if state["turn"] >= self.max_turns:
                state["stop_reason"] = StopReason.MAX_TURNS
                break
            env_messages, state = await maybe_await(self.env_response(messages, state))
            messages.extend(env_messages)
            state["completion"].extend(env_messages)
        return state["completion"], state
