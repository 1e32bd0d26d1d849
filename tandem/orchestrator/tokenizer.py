"""The only piece of the model the orchestrator loads: its tokenizer (never torch weights)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tandem.config.base import ModelConfig

GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
"""`tokenizer_class` values that name transformers' generic tokenizer over a `tokenizer.json` (tandem's presets
write the first)."""


def load_tokenizer(model: ModelConfig) -> Any:
    """The tokenizer of `model.name`, with a chat template (the orchestrator renders every turn).

    A folder whose tokenizer is the generic one is loaded by that class: `AutoTokenizer` would find the same class
    through transformers' model-config module, which imports torch, seconds of CPU at each start of a process
    that never uses it."""
    if has_generic_tokenizer(model):
        from transformers import PreTrainedTokenizerFast as loader  # naming AutoTokenizer would import torch already
    else:
        from transformers import AutoTokenizer as loader
    tokenizer = loader.from_pretrained(model.name, trust_remote_code=model.trust_remote_code)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer of {model.name!r} has no chat template; the orchestrator renders "
                         "conversations with it (set `model.name` to a chat model folder)")
    return tokenizer


def has_generic_tokenizer(model: ModelConfig) -> bool:
    config = Path(model.name) / "tokenizer_config.json"
    return (not model.trust_remote_code and config.is_file()
            and json.loads(config.read_text()).get("tokenizer_class") in GENERIC_TOKENIZER_CLASSES)
