"""The FastAPI app: routes, OpenAI-style errors, the optional API key, the OpenAPI document, the engine's lifetime."""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI

from tandem.config.inference import DisaggregationConfig, ServerConfig
from tandem.inference import admin_api, generate_api, openai_api, weight_transfer_api
from tandem.inference.api_key import RequireAPIKey
from tandem.inference.body_limit import BodyLimit
from tandem.inference.disaggregated import decode
from tandem.inference.disaggregated.prefill_api import install_prefill_routes
from tandem.inference.errors import error_responses, install_error_handlers
from tandem.inference.openapi import complete_openapi
from tandem.inference.serving import Served
from tandem.inference.weight_receiver import WeightReceiver


def build_app(served: Served, server: ServerConfig, disaggregation: DisaggregationConfig = DisaggregationConfig()) -> FastAPI:
    """The app over a built engine; the engine thread runs while the app does. `disaggregation.role` adds a prefill
    server's routes, or a decode server's (whose `served.remote_prefill` the caller set)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        served.engine.start()
        try:
            yield
        finally:
            served.engine.shutdown()
            app.state.weight_receiver.close()
            for close in app.state.closers:
                close()
            if served.remote_prefill is not None:
                served.remote_prefill.log_stats()
                await served.remote_prefill.peers.aclose()

    app = FastAPI(title="tandem inference", lifespan=lifespan)
    app.state.served = served
    app.state.weight_receiver = WeightReceiver(served.engine.engine.device, server.weight_transfer_timeout_s)
    app.state.closers = []
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=server.max_request_bytes)
    if server.api_key is not None:
        app.add_middleware(RequireAPIKey, api_key=server.api_key)  # added last: runs first, before any body is read
    app.include_router(admin_api.public)
    responses = error_responses(401) if server.api_key is not None else {}
    for router in (admin_api.router, openai_api.router, generate_api.router, weight_transfer_api.router):
        app.include_router(router, responses=responses)
    if disaggregation.role == "prefill":
        install_prefill_routes(app, disaggregation, responses)
    elif disaggregation.role == "decode":
        app.include_router(decode.router, responses=responses)
    complete_openapi(app, served.model_name, served.max_model_len, served.engine.engine.vocab_size,
                     needs_api_key=server.api_key is not None)
    return app
