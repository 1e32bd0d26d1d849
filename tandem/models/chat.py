"""A model's chat format, for every process that talks to it: conversations in, tool calls out.

Prompts are rendered by the tokenizer's own chat template (it knows the model's format, tools
included). Calls are read back Hermes-style, as Qwen's templates (and tandem's byte tokenizer's)
teach models to write them: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. The
inference server and the orchestrator both use this module, so a completion means the same thing
whichever of them reads it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
# A block and the whitespace after it: removing both joins the text around it as the model spaced it.
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>\s*", re.DOTALL)


class ChatTemplateError(ValueError):
    """The chat template rejected the conversation."""


class NoChatTemplate(ChatTemplateError):
    """The tokenizer has no chat template."""


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str
    """The arguments object as a JSON string, as the OpenAI API carries it."""


def render_chat(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True,
                continue_final_message: bool = False, template_kwargs: dict | None = None) -> list[int]:
    """Prompt token ids of a conversation, through the tokenizer's chat template."""
    text = render_chat_text(tokenizer, messages, tools, add_generation_prompt, continue_final_message, template_kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


def render_chat_text(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True,
                     continue_final_message: bool = False, template_kwargs: dict | None = None) -> str:
    """`render_chat`'s text, before tokenization (`tokenizer(texts, add_special_tokens=False)` encodes many at once)."""
    if not getattr(tokenizer, "chat_template", None):
        raise NoChatTemplate("the model's tokenizer has no chat template")
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message, tokenize=False, **(template_kwargs or {}),
        )
    except Exception as err:  # jinja raises TemplateError (and raise_exception() in templates) for bad conversations
        raise ChatTemplateError(f"the chat template rejected the messages: {err}") from None


def parse_tool_calls(text: str) -> tuple[str, list[ParsedToolCall]]:
    """(the text outside the valid call blocks, trailing whitespace removed; the valid calls in order).

    Text after a call is kept, not dropped: it is what the model wrote (an answer or a remark after
    its call), an OpenAI message has one `content` for all of it, and an environment that scores or
    replays the message must see every word the model produced. A block whose JSON does not parse,
    or lacks a string `name`, is no call: it stays in the text for the same reason. The text keeps its
    start as written, so a stream that sent the part before the first call can send the rest as a suffix.
    """
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
    return (rest.rstrip() if calls else text), calls


def streamable_content(text: str) -> str:
    """The part of a growing completion that is surely content, not the start of a tool call."""
    cut = text.find(TOOL_CALL_OPEN)
    if cut >= 0:
        return text[:cut]
    for k in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):  # a partial "<tool_c" at the end
        if text.endswith(TOOL_CALL_OPEN[:k]):
            return text[:-k]
    return text
