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
from starlette.exceptions import HTTPException

log = logging.getLogger(__name__)

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 409: "conflict_error", 500: "internal_server_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"), "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def describe_validation_error(err: RequestValidationError) -> tuple[str, str | None]:
    """One readable clause per bad field: `field.path`: what is wrong (got what)."""
    by_field: dict[str, list[str]] = {}
    inputs: dict[str, object] = {}
    for e in err.errors():
        if e["type"] == "json_invalid":
            return f"malformed JSON body: {e.get('ctx', {}).get('error', e['msg'])}", None
        loc = [str(p) for p in e["loc"][1:]]  # [0] is "body"
        if not loc:
            return "the request body must be a JSON object (sent with `Content-Type: application/json`)", None
        # A union reports each member it tried, tagged with the member's type (`stop.str`): drop the tag.
        loc = [p for p in loc if not _is_type_tag(p)]
        field = ".".join(loc)
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
        elif e["type"] == "missing":
            msg = "missing field"
        else:
            msg = e["msg"].removeprefix("Value error, ")
            inputs.setdefault(field, e.get("input"))
        by_field.setdefault(field, [])
        if msg not in by_field[field]:
            by_field[field].append(msg)
    clauses = []
    for field, msgs in by_field.items():
        got = f" (got {json.dumps(inputs[field], default=str)[:100]})" if field in inputs else ""
        clauses.append(f"`{field}`: {' or '.join(msgs)}{got}" if field else " or ".join(msgs))
    return "; ".join(clauses), next(iter(by_field)) or None


def _is_type_tag(part: str) -> bool:
    return part in ("str", "int", "float", "bool", "none") or "[" in part or part.startswith("function-")


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
        return error_response(err.status_code, str(err.detail))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(err).__name__}: {err}")
