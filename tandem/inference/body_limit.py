"""The request body size limit, enforced before anything parses the body.

A body longer than `server.max_request_bytes` is answered 413 as soon as its `Content-Length` says
so, or, sent in chunks, once the bytes read pass the limit: the server never holds or parses more.
The limit also bounds the work done on the event loop: the body's JSON is parsed and validated
there (CPU work that holds the GIL), so the limit is what keeps one request from delaying the others.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tandem.inference.errors import error_response


class BodyLimit:
    """ASGI middleware: read the whole body (up to `max_bytes`), then hand it to the app."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if delivered:
                return await receive()  # after the body: only the client's disconnect comes
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = (f"the request body is larger than this server's limit of {self.max_bytes} bytes "
                   "(`server.max_request_bytes`)")
        response = error_response(413, message)
        response.headers["connection"] = "close"  # the rest of the body is not read
        await response(scope, receive, send)
