"""The server's side of the chat format (`tandem/models/chat.py`): its errors as API errors, its
tool calls as OpenAI `tool_calls` entries with ids."""

from __future__ import annotations

import uuid
from typing import Any

from tandem.inference.errors import APIError
from tandem.models import chat


def render_chat(tokenizer: Any, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool,
                continue_final_message: bool, template_kwargs: dict | None) -> list[int]:
    """Prompt token ids of a conversation; a conversation the template cannot render is a 400."""
    try:
        return chat.render_chat(tokenizer, messages, tools, add_generation_prompt, continue_final_message, template_kwargs)
    except chat.NoChatTemplate as err:
        raise APIError(400, f"{err}: use /v1/completions or /v1/generate") from None
    except chat.ChatTemplateError as err:
        raise APIError(400, str(err), "messages") from None


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """A completion's content (None when only calls remain, as OpenAI sends it) and its OpenAI tool calls."""
    content, calls = chat.parse_tool_calls(text)
    if not calls:
        return text, []
    return content or None, [
        {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
    ]
