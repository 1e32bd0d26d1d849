"""The only piece of the model the orchestrator loads: its tokenizer (never torch weights)."""

from __future__ import annotations

from typing import Any

from tandem.config.base import ModelConfig


def load_tokenizer(model: ModelConfig) -> Any:
    """The tokenizer of `model.name`, with a chat template (the orchestrator renders every turn)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model.name, trust_remote_code=model.trust_remote_code)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer of {model.name!r} has no chat template; the orchestrator renders "
                         "conversations with it (set `model.name` to a chat model folder)")
    return tokenizer
