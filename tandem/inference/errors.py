"""OpenAI-style errors: every failure is `{"error": {"message", "type", "param", "code"}}`.

Bad input is a 4xx whose message names what was wrong; an unexpected failure is a 500. Either
way the server keeps serving.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error",
               429: "rate_limit_error", 500: "internal_server_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


class ErrorDetail(BaseModel):
    message: str
    """What was wrong, naming the field and the value received."""
    type: str
    param: str | None
    """The top-level request field at fault, if one is."""
    code: int
    """The HTTP status."""


class ErrorResponse(BaseModel):
    """The body of every error response (the OpenAPI document declares it for each error status)."""

    error: ErrorDetail


def error_body(status: int, message: str, param: str | None = None) -> dict:
    detail = ErrorDetail(message=message, type=ERROR_TYPES.get(status, "invalid_request_error"), param=param, code=status)
    return ErrorResponse(error=detail).model_dump()


ERROR_DESCRIPTIONS = {
    400: "Bad request: a field is missing, unknown, of the wrong type or out of range (`param` names it)",
    401: "Missing or wrong API key",
    404: "Unknown model, or no weights where `path` says",
    409: "A weight-transfer call out of order: no group joined, or no weight update open (or one already open)",
    413: "Request body over `server.max_request_bytes`",
    429: "A prefill server holds `disaggregation.max_held_mib` of prompts its decode servers have not taken yet: ask "
         "again later",
    500: "The engine failed while generating",
    "default": "Any other error",
}


def error_responses(*statuses: int) -> dict:
    """OpenAPI `responses` of a route: its error statuses, and `default` (any other status) with the same body.

    Declaring them also keeps FastAPI from declaring its own 422, a status this server never answers.
    """
    return {status: {"model": ErrorResponse, "description": ERROR_DESCRIPTIONS[status]} for status in (*statuses, "default")}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def describe_validation_error(err: RequestValidationError) -> tuple[str, str | None]:
    """One readable clause per bad field: `field.path`: what is wrong (got what)."""
    clauses: dict[str, list[str]] = {}
    inputs: dict[str, object] = {}
    for e in err.errors():
        if e["type"] == "json_invalid":
            return f"malformed JSON body: {e.get('ctx', {}).get('error', e['msg'])}", None
        # loc[0] is "body"; a union reports each member it tried, tagged with its type (`stop.str`).
        field = ".".join(str(p) for p in e["loc"][1:] if not _is_type_tag(str(p)))
        if not field and e["type"] == "missing":
            return "the request body is empty: send a JSON object (with `Content-Type: application/json`)", None
        if not field and e["type"] in ("model_attributes_type", "dict_type", "model_type"):
            return "the request body must be a JSON object (sent with `Content-Type: application/json`)", None
        if e["type"] == "extra_forbidden":
            clauses.setdefault(field, []).append(f"unknown field `{field}`")
            continue
        if e["type"] == "missing":
            clauses.setdefault(field, []).append(f"missing field `{field}`")
            continue
        msg = e["msg"].removeprefix("Value error, ")
        if field:
            inputs.setdefault(field, e.get("input"))
        if msg not in clauses.setdefault(field, []):
            clauses[field].append(msg)
    parts = []
    for field, msgs in clauses.items():
        text = " or ".join(msgs)
        if field in inputs:
            text = f"`{field}`: {text} (got {json.dumps(inputs[field], default=str)[:100]})"
        parts.append(text)
    # `param` is the top-level field (`stop`, not `stop.0`): the argument the client set; the message has the path.
    return "; ".join(parts), next(iter(clauses)).split(".")[0] or None


BODY_FORMS = ("folder", "broadcast")
"""Tags of the forms of a body that has several (`/update_weights`): an error's path holds its form's tag, which
names no field."""


def _is_type_tag(part: str) -> bool:
    return (part in ("str", "int", "float", "bool", "none") or part in BODY_FORMS or "[" in part
            or part.startswith(("function-", "constrained-")))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError) -> JSONResponse:
        return error_response(err.status, err.message, err.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_error(err)
        return error_response(400, message, param)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, err: HTTPException) -> JSONResponse:
        response = error_response(err.status_code, str(err.detail))
        response.headers.update(err.headers or {})  # a 405 says which methods are allowed
        return response

    app.add_middleware(AnswerUnexpectedErrors)


class AnswerUnexpectedErrors:
    """ASGI middleware: an unexpected exception becomes a 500 error response, and goes no further.

    Starlette's last-resort handler answers, then re-raises, and uvicorn then closes the connection:
    the client's next request on that keep-alive connection was reset. Here the exception ends with
    the answer. Only one raised after the response started (mid-stream) goes on: closing the
    connection is then the only way to tell the client the response is incomplete.
    """

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception as err:
            log.exception("unexpected error on %s %s", scope["method"], scope["path"])
            if started:
                raise
            await error_response(500, f"internal error: {type(err).__name__}: {err}")(scope, receive, send)
