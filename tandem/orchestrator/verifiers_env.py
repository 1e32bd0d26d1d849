"""Running `verifiers` environments (the `tandem-rl[verifiers]` extra) through the orchestrator.

verifiers 0.2-0.3 environments roll out with `env.rollout(input, client, model, sampling_args)
-> state`, where `client` is a `verifiers.Client` (a provider adapter) and every turn's tokens
land in `state["trajectory"]`. `VerifiersEnv` gives such an environment tandem's shape, and
`tandem_client` wraps the orchestrator's token-keeping client as a `verifiers.Client`, so the
orchestrator still records each turn's exact token ids, logprobs and policy version itself.
Classic environments (`rollout(client, model, prompt, ...)`) need no adapter.

verifiers is imported only here, and only when such an environment is loaded.
"""

from __future__ import annotations

import functools
from typing import Any

from tandem.envs.types import RolloutScore


def tandem_client(chat_client: Any) -> Any:
    """`chat_client` (the orchestrator's `TokenChatClient`) as a `verifiers.Client`."""
    return _client_class()(chat_client)


@functools.cache
def _client_class() -> type:
    import verifiers as vf

    class TandemClient(vf.Client):
        def setup_client(self, config: Any) -> Any:
            raise TypeError("TandemClient wraps the orchestrator's client; it is not built from a ClientConfig")

        async def to_native_tool(self, tool: Any) -> dict[str, Any]:
            return {"type": "function",
                    "function": {"name": tool.name, "description": tool.description, "parameters": tool.parameters}}

        async def to_native_prompt(self, messages: Any) -> tuple[list[dict[str, Any]], dict]:
            return [openai_message(m) for m in messages], {}

        async def get_native_response(self, prompt: list[dict[str, Any]], model: str, sampling_args: dict[str, Any],
                                      tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> Any:
            # `state` and `extra_headers` are for HTTP providers; this client needs neither.
            return await self.client.chat.completions.create(model=model, messages=prompt, tools=tools,
                                                             **sampling_args)

        async def raise_from_native_response(self, response: Any) -> None:
            """An empty answer is a valid (bad) answer for RL: the rubric scores it."""

        async def from_native_response(self, response: Any) -> Any:
            choice = response.choices[0]
            calls = [vf.ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
                     for c in choice.message.tool_calls or []]
            tokens = vf.ResponseTokens(
                prompt_ids=response.prompt_token_ids, prompt_mask=[0] * len(response.prompt_token_ids),
                completion_ids=choice.token_ids, completion_mask=[1] * len(choice.token_ids),
                completion_logprobs=[t.logprob for t in choice.logprobs.content],
            )
            usage = vf.Usage(prompt_tokens=response.usage.prompt_tokens, reasoning_tokens=0,
                             completion_tokens=response.usage.completion_tokens, total_tokens=response.usage.total_tokens)
            message = vf.ResponseMessage(content=choice.message.content, tool_calls=calls or None,
                                         finish_reason=choice.finish_reason, is_truncated=choice.finish_reason == "length",
                                         tokens=tokens)
            return vf.Response(id=response.id, created=response.created, model=response.model, usage=usage,
                               message=message)

        async def close(self) -> None:
            """The orchestrator owns the HTTP pool."""

    return TandemClient


def openai_message(message: Any) -> dict[str, Any]:
    """A verifiers message (pydantic model or dict) as an OpenAI chat dict."""
    data = message.model_dump(exclude_none=True) if hasattr(message, "model_dump") else dict(message)
    if data.get("tool_calls"):
        data["tool_calls"] = [
            call if "function" in call else
            {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}
            for call in data["tool_calls"]
        ]
    return data


class VerifiersEnv:
    """A trajectory-API verifiers environment in tandem's environment shape."""

    def __init__(self, env: Any):
        self.env = env
        self.rubric = _VerifiersRubric(env)

    def get_dataset(self, n: int = -1, seed: int | None = None) -> Any:
        return self.env.get_dataset(n=n, seed=seed)

    def get_eval_dataset(self, n: int = -1, seed: int | None = None) -> Any:
        return self.env.get_eval_dataset(n=n, seed=seed)

    async def rollout(self, client: Any, model: str, prompt: list[dict[str, Any]], answer: str = "",
                      task: str = "default", info: dict[str, Any] | None = None,
                      sampling_args: dict[str, Any] | None = None) -> tuple[list[dict[str, Any]], dict]:
        # No `task`: verifiers 0.3 reads it as a serialized task payload, not tandem's label.
        rollout_input = {"prompt": prompt, "example_id": 0, "answer": answer, "info": info or {}}
        state = await self.env.rollout(rollout_input, tandem_client(client), model, sampling_args or {})
        if state.get("error") is not None:
            raise RuntimeError(f"verifiers rollout failed: {state['error']!r}")
        state["stop_reason"] = state.get("stop_condition")
        return [openai_message(m) for m in state.get("completion") or []], state


class _VerifiersRubric:
    """tandem's `score_rollout(prompt, completion, answer, state, task, info)` on a verifiers rubric,
    which reads everything from the state and writes `reward` and `metrics` into it."""

    def __init__(self, env: Any):
        self.env = env

    async def score_rollout(self, prompt: Any, completion: Any, answer: str, state: Any, task: str = "default",
                            info: dict[str, Any] | None = None) -> RolloutScore:
        await self.env.rubric.score_rollout(state)
        await self.env.rubric.cleanup(state)
        return RolloutScore(reward=float(state["reward"]), metrics=dict(state.get("metrics") or {}))
