"""Incremental detokenization: the text a completion gains with each new token.

Decoding the whole completion at every step costs O(n^2); decoding only the newest token breaks
characters that span several tokens (byte-level BPE). The standard middle way, kept here: decode
a short window twice, the text up to the last emitted token and the text with the new tokens, and
emit the difference once it no longer ends in an incomplete character (U+FFFD).
"""

from __future__ import annotations

from typing import Any

INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.prefix_offset = 0
        """Start of the decoding window: tokens before it are already text."""
        self.read_offset = 0
        """End of the tokens whose text has been emitted."""

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_ids: list[int]) -> str:
        """New text given all completion tokens so far ("" while a character is incomplete)."""
        prefix = self._decode(token_ids[self.prefix_offset:self.read_offset])
        full = self._decode(token_ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith(INCOMPLETE):
            self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
            return full[len(prefix):]
        return ""

    def flush(self, token_ids: list[int]) -> str:
        """The text still held back (an incomplete last character) when the completion ends."""
        prefix = self._decode(token_ids[self.prefix_offset:self.read_offset])
        full = self._decode(token_ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(token_ids)
        return full[len(prefix):]
