"""Hermes-style tool calls (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), the format
Qwen's chat templates (and tandem's byte tokenizer template) teach models to write.

A block whose JSON does not parse, or lacks a string `name`, stays in the text: the model did not
make a valid call, and the environment sees what it wrote.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str
    """The arguments object as a JSON string, as the OpenAI API carries it."""


def parse_tool_calls(text: str) -> tuple[str, list[ParsedToolCall]]:
    """(text outside the valid blocks, stripped; the valid calls in order)."""
    calls: list[ParsedToolCall] = []

    def take(match: re.Match[str]) -> str:
        try:
            obj = json.loads(match.group(1))
        except json.JSONDecodeError:
            return match.group(0)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return match.group(0)
        arguments = obj.get("arguments", {})
        calls.append(ParsedToolCall(obj["name"], arguments if isinstance(arguments, str) else json.dumps(arguments)))
        return ""

    rest = _BLOCK.sub(take, text)
    return (rest.strip() if calls else text), calls
