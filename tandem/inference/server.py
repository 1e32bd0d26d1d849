"""`tandem inference` with tandem's own engine: load the model, start the engine, serve the API until stopped."""

from __future__ import annotations

import gc
import logging
import socket
import sys
import threading
import time

import uvicorn

from tandem.config.inference import InferenceConfig, ServerConfig
from tandem.inference.app import build_app
from tandem.inference.disaggregated import connect_prefill_servers
from tandem.inference.disaggregated.peers import PeerUnreachable
from tandem.inference.engine.async_engine import AsyncEngine
from tandem.inference.engine.setup import build_engine
from tandem.inference.serving import Served
from tandem.transport.paths import shared_base_file

log = logging.getLogger("tandem.inference")

GC_YOUNG_THRESHOLD = 50_000
"""Allocations between two young-generation collections (Python's default: 700). A finished batch of
completions builds an object per token of every answer at once (logprob entries), and the engine thread
builds objects every step; at the default each of those triggers collections that rescan what survived,
holding the interpreter lock for the engine thread and the event loop alike."""


def settle_heap() -> None:
    """Keep the garbage collector off the serving path: what startup built (modules, the model's Python
    objects, the app) lives as long as the server, so it is frozen out of every later collection, and
    young collections run less often (see GC_YOUNG_THRESHOLD). Garbage cycles are still collected."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


def set_switch_interval(server: ServerConfig) -> None:
    """`server.switch_interval_ms`, for this process's threads (the engine's and the HTTP side's)."""
    if server.switch_interval_ms is not None:
        sys.setswitchinterval(server.switch_interval_ms / 1000)
        log.info("interpreter lock switch interval: %g ms", sys.getswitchinterval() * 1000)


def build_served(config: InferenceConfig) -> Served:
    """The engine and everything the routes need, built from the config (loads the model; a decode server also
    checks its prefill servers: `PeerUnreachable`)."""
    shared = shared_base_file(config.run_dir) if config.engine.lora.share_base else None
    engine = build_engine(config.model, config.engine, config.seed, config.run.exact, config.base_serving, shared)
    if config.disaggregation.role != "colocated" and not hasattr(engine.runner, "cache"):
        raise ValueError(f"`disaggregation.role` = {config.disaggregation.role!r}: {config.model.name} is no model native "
                         "to tandem, and the transformers path it runs on recomputes every step from the tokens: it "
                         "keeps no KV cache to hand over; serve it colocated")
    base_name = config.base_served_name if engine.base_path is not None else None
    served = Served(AsyncEngine(engine), engine.tokenizer, config.model.name, engine.max_model_len, base_name)
    if config.disaggregation.role == "decode":
        served.remote_prefill = connect_prefill_servers(config, served.engine)
    threading.Thread(target=served.fill_token_texts, args=(engine.vocab_size,), name="tandem-token-texts", daemon=True).start()
    return served


class BackgroundServer:
    """The whole server in a thread of this process, on a free loopback port (tests, benchmarks)."""

    def __init__(self, config: InferenceConfig, start_timeout_s: float = 60.0):
        self.served = build_served(config)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        app = build_app(self.served, config.server, config.disaggregation)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the background inference server did not start")
            time.sleep(0.02)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def main(config: InferenceConfig) -> int:
    try:
        served = build_served(config)
    except (ValueError, FileNotFoundError, PeerUnreachable) as err:
        print(f"tandem inference: {err}", file=sys.stderr)
        return 2
    app = build_app(served, config.server, config.disaggregation)
    settle_heap()
    set_switch_interval(config.server)
    log.info("serving %s on http://%s:%d", config.model.name, config.server.host, config.server.port)
    uvicorn.run(app, host=config.server.host, port=config.server.port, access_log=config.server.access_log, log_level="info")
    return 0
