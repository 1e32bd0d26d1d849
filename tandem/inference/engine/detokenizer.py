"""Incremental detokenization: the text a completion gains with each new token.

Decoding the whole completion at every step costs O(n^2); decoding only the newest token breaks
characters that span several tokens (byte-level BPE). The standard middle way, kept here: decode
a short window twice, the text up to the last emitted token and the text with the new tokens, and
emit the difference once it no longer ends in an incomplete character (U+FFFD).

A server streaming a batch decodes twice per sequence and step on the engine thread, so each decode goes straight to
the Rust tokenizer where that gives the same text: `transformers`' `decode` first walks the ids in Python (type
checks and a copy, O(window) per call) before the Rust decode.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

INCOMPLETE = "\ufffd"


def text_decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """`tokenizer.decode` of a list of ids: the Rust tokenizer's own `decode` for a fast tokenizer whose `decode`
    is `transformers`' (which then returns exactly that text: no subclass changes it, no clean-up of spaces runs);
    else the tokenizer's `decode`, looked up when text is asked for (a sequence that never needs text may have no
    tokenizer)."""
    kind = type(tokenizer)
    if (isinstance(tokenizer, PreTrainedTokenizerFast) and kind.decode is PreTrainedTokenizerBase.decode
            and kind._decode is PreTrainedTokenizerFast._decode and not tokenizer.clean_up_tokenization_spaces):
        return partial(tokenizer.backend_tokenizer.decode, skip_special_tokens=skip_special_tokens)
    return lambda token_ids: tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool):
        self._decode = text_decoder(tokenizer, skip_special_tokens)
        self.prefix_offset = 0
        """Start of the decoding window: tokens before it are already text."""
        self.read_offset = 0
        """End of the tokens whose text has been emitted."""
        self._prefix: str | None = None
        """The text of the tokens [prefix_offset, read_offset) once decoded: while tokens add no text (an incomplete
        character, ids without text) the window only grows, and its start needs no decoding again."""

    def push(self, token_ids: list[int]) -> str:
        """New text given all completion tokens so far ("" while a character is incomplete)."""
        prefix = self._prefix_text(token_ids)
        full = self._decode(token_ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith(INCOMPLETE):
            self.prefix_offset, self.read_offset, self._prefix = self.read_offset, len(token_ids), None
            return full[len(prefix):]
        return ""

    def flush(self, token_ids: list[int]) -> str:
        """The text still held back (an incomplete last character) when the completion ends."""
        prefix = self._prefix_text(token_ids)
        full = self._decode(token_ids[self.prefix_offset:])
        self.prefix_offset, self.read_offset, self._prefix = len(token_ids), len(token_ids), None
        return full[len(prefix):]

    def _prefix_text(self, token_ids: list[int]) -> str:
        if self._prefix is None:
            self._prefix = self._decode(token_ids[self.prefix_offset:self.read_offset])
        return self._prefix
