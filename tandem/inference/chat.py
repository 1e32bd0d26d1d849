"""Chat prompts and tool calls: the tokenizer's chat template in, OpenAI `tool_calls` out.

Tools are rendered by the model's own chat template (it knows its format). Calls are read back
Hermes-style, as Qwen writes them: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
blocks; a block that is not valid JSON with a `name` stays plain text.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from tandem.inference.errors import APIError

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def render_chat(tokenizer: Any, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool,
                continue_final_message: bool, template_kwargs: dict | None) -> list[int]:
    """Prompt token ids of a conversation, through the tokenizer's chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "the model's tokenizer has no chat template: use /v1/completions or /v1/generate")
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message, tokenize=False, **(template_kwargs or {}),
        )
    except Exception as err:  # jinja raises TemplateError (and raise_exception() in templates) for bad conversations
        raise APIError(400, f"the chat template rejected the messages: {err}", "messages") from None
    return tokenizer.encode(text, add_special_tokens=False)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """Split a completion into its content (text before the first call) and OpenAI tool calls."""
    calls = []
    first = None
    for match in TOOL_CALL_BLOCK.finditer(text):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        first = match.start() if first is None else first
        arguments = call.get("arguments", {})
        calls.append({
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": call["name"], "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)},
        })
    if not calls:
        return text, []
    content = text[:first].strip()
    return content or None, calls


def streamable_content(text: str) -> str:
    """The part of a growing completion that is surely content, not the start of a tool call."""
    cut = text.find(TOOL_CALL_OPEN)
    if cut >= 0:
        return text[:cut]
    for k in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):  # a partial "<tool_c" at the end
        if text.endswith(TOOL_CALL_OPEN[:k]):
            return text[:-k]
    return text
