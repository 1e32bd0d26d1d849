"""The server-sent events of a streamed answer: `data: <chunk JSON>\\n\\n`, each chunk's JSON byte for byte what
`json.dumps` writes for its dict (default separators, ASCII escapes, `NaN`/`Infinity`/`-Infinity` for floats that
are not finite).

A stream sends one chunk per token and request, and the event loop that encodes them shares the interpreter lock
with the engine thread. So the fields every chunk of a stream repeats (`id`, `created`, `model`, `object`) are
encoded once, and a completion's choice is written from its parts, `json.dumps` only for its logprobs.
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring_ascii as json_string


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def json_ints(values: list[int]) -> str:
    """`json.dumps` of a list of plain ints (token ids)."""
    return f"[{', '.join(map(str, values))}]"


class ChunkEvents:
    """The events of one stream's chunks `{**meta, "object": object_name, "choices": [choice]}`, given the choice's
    JSON."""

    def __init__(self, meta: dict, object_name: str):
        self.chunk = {**meta, "object": object_name}
        """The fields every chunk starts with (the usage chunk and the first chat chunk are built from it)."""
        self._head = f'data: {json.dumps(self.chunk)[:-1]}, "choices": ['

    def event(self, choice_json: str) -> str:
        return f"{self._head}{choice_json}]}}\n\n"


def completion_choice(index: int, text: str, logprobs: dict | None, finish_reason: str | None,
                      token_ids: list[int] | None = None, prompt_token_ids: list[int] | None = None,
                      weight_version: int | None = None) -> str:
    """The JSON of a streamed completion's choice, as `json.dumps` writes the dict of these fields in this order,
    `token_ids`, `prompt_token_ids` and `weight_version` only where given."""
    out = (f'{{"index": {index}, "text": {json_string(text)}, '
           f'"logprobs": {"null" if logprobs is None else json.dumps(logprobs)}, '
           f'"finish_reason": {"null" if finish_reason is None else json_string(finish_reason)}')
    if token_ids is not None:
        out += f', "token_ids": {json_ints(token_ids)}'
    if prompt_token_ids is not None:
        out += f', "prompt_token_ids": {json.dumps(prompt_token_ids)}'
    if weight_version is not None:
        out += f', "weight_version": {json.dumps(weight_version)}'
    return out + "}"
