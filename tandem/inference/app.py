"""The FastAPI app: routes, OpenAI-style errors, the optional API key, the engine's lifetime."""

from __future__ import annotations

import secrets
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request

from tandem.config.inference import ServerConfig
from tandem.inference import admin_api, generate_api, openai_api, weight_transfer_api
from tandem.inference.body_limit import BodyLimit
from tandem.inference.errors import APIError, error_responses, install_error_handlers
from tandem.inference.serving import Served
from tandem.inference.weight_receiver import WeightReceiver


def require_api_key(api_key: str | None):
    async def check(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.encode(), api_key.encode()):
            raise APIError(401, "missing or wrong API key: send `Authorization: Bearer <api_key>`")

    return check


def build_app(served: Served, server: ServerConfig) -> FastAPI:
    """The app over a built engine; the engine thread runs while the app does."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        served.engine.start()
        try:
            yield
        finally:
            served.engine.shutdown()
            app.state.weight_receiver.close()

    app = FastAPI(title="tandem inference", lifespan=lifespan)
    app.state.served = served
    app.state.weight_receiver = WeightReceiver(served.engine.engine.device, server.weight_transfer_timeout_s)
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=server.max_request_bytes)  # added last: runs first
    guarded = [Depends(require_api_key(server.api_key))]
    app.include_router(admin_api.public)
    responses = error_responses(401) if server.api_key is not None else {}
    for router in (admin_api.router, openai_api.router, generate_api.router, weight_transfer_api.router):
        app.include_router(router, dependencies=guarded, responses=responses)
    return app
