"""The server's OpenAPI document: FastAPI's, generated from the request models, completed with what only the
running server knows, so that a client written from the document knows every reason for a 400 or a 401.

- The served model's limits: no JSON Schema can say that a token id must be below the vocabulary size or that a
  prompt plus `max_tokens` must fit the context. The request models mark the fields these bounds apply to
  (`protocol.BELOW_VOCAB_SIZE`, `protocol.WITHIN_CONTEXT`); each mark becomes a sentence of the field's
  description with this server's number, and the document's own description states both.
- The API key, when `server.api_key` is set: a bearer security scheme required by every operation but
  `GET /health` (`tandem.inference.api_key`).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from tandem.inference.api_key import OPEN_PATHS
from tandem.inference.protocol import BELOW_VOCAB_SIZE, WITHIN_CONTEXT


def complete_openapi(app: FastAPI, model_name: str, max_model_len: int, vocab_size: int, needs_api_key: bool) -> None:
    """Make `app.openapi` (what `GET /openapi.json` serves) the completed document, built once on first use."""
    generate = app.openapi
    limits = {BELOW_VOCAB_SIZE: f"Each token id below {vocab_size}, the vocabulary size of this server's model "
                                  "(else a 400).",
              WITHIN_CONTEXT: f"Prompt tokens plus completion tokens (`max_tokens`) at most {max_model_len}, the "
                              "context length of this server's model (else a 400)."}

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = generate()  # FastAPI's, which it keeps as `app.openapi_schema`: completed in place
            document["info"]["description"] = (
                f"Serves `{model_name}`: a context of {max_model_len} tokens (prompt plus completion) and a vocabulary "
                f"of {vocab_size} token ids. Requests beyond either are refused with a 400 naming the field, though "
                "the schemas cannot say so; the fields concerned say so in their descriptions.")
            _describe_limits(document, limits)
            if needs_api_key:
                _require_bearer(document)
        return app.openapi_schema

    app.openapi = openapi


def _describe_limits(node: Any, limits: dict[str, str]) -> None:
    """Replace each limit mark in the schemas under `node` by its sentence, appended to the description."""
    if isinstance(node, list):
        for item in node:
            _describe_limits(item, limits)
        return
    if not isinstance(node, dict):
        return
    for mark, sentence in limits.items():
        if node.pop(mark, False):
            node["description"] = f"{node['description']} {sentence}" if node.get("description") else sentence
    for value in node.values():
        _describe_limits(value, limits)


def _require_bearer(document: dict[str, Any]) -> None:
    document.setdefault("components", {})["securitySchemes"] = {"bearer": {
        "type": "http", "scheme": "bearer", "description": "`server.api_key`: `Authorization: Bearer <api_key>`"}}
    document["security"] = [{"bearer": []}]
    for path in OPEN_PATHS:
        for operation in document["paths"].get(path, {}).values():
            operation["security"] = []
