"""`tandem inference`: load the model, start the engine, serve the API until stopped."""

from __future__ import annotations

import logging
import sys

import uvicorn

from tandem.config.inference import InferenceConfig
from tandem.inference.app import build_app
from tandem.inference.engine.async_engine import AsyncEngine
from tandem.inference.engine.setup import build_engine
from tandem.inference.serving import Served

log = logging.getLogger("tandem.inference")


def build_served(config: InferenceConfig) -> Served:
    """The engine and everything the routes need, built from the config (loads the model)."""
    engine = build_engine(config.model, config.engine, config.seed)
    return Served(AsyncEngine(engine), engine.tokenizer, config.model.name, engine.max_model_len)


def main(config: InferenceConfig) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.backend == "vllm":
        try:
            from tandem.inference.vllm.server import main as vllm_main  # built by the vLLM backend's issue
        except ModuleNotFoundError as err:
            print(f"tandem inference: backend `vllm` is not available here ({err}); use `--backend tandem`", file=sys.stderr)
            return 2
        return vllm_main(config)
    try:
        served = build_served(config)
    except (ValueError, FileNotFoundError) as err:
        print(f"tandem inference: {err}", file=sys.stderr)
        return 2
    log.info("serving %s on http://%s:%d", config.model.name, config.server.host, config.server.port)
    uvicorn.run(build_app(served, config.server.api_key), host=config.server.host, port=config.server.port,
                access_log=config.server.access_log, log_level="info")
    return 0
