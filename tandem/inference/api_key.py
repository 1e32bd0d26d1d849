"""The API key (`server.api_key`): every request but `GET /health` must carry `Authorization: Bearer <api_key>`.

Checked before routing, for whatever path a request names: no route can be left out, FastAPI's own
(`/openapi.json`, `/docs`) and routes added later included, and a request without the key learns nothing of
the server, not even which paths exist. The body of a refused request is never read.
"""

from __future__ import annotations

import secrets

from starlette.types import ASGIApp, Receive, Scope, Send

from tandem.inference.errors import error_response

OPEN_PATHS = ("/health",)
"""Paths served without the key: liveness checks (the launcher's, a load balancer's) carry none."""


class RequireAPIKey:
    """ASGI middleware: a request without the key is answered 401 (an OpenAI-style error) and goes no further."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.token = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._carries_key(scope):
            await self.app(scope, receive, send)
            return
        response = error_response(401, "missing or wrong API key: send `Authorization: Bearer <api_key>`")
        response.headers["www-authenticate"] = "Bearer"
        await response(scope, receive, send)

    def _carries_key(self, scope: Scope) -> bool:
        header = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        scheme, _, token = header.partition(b" ")
        # compare_digest: the time taken does not tell how much of a guess was right.
        return scheme.lower() == b"bearer" and secrets.compare_digest(token, self.token)
