"""A small fake of the inference server's HTTP contract, for orchestrator tests.

Speaks `POST /v1/generate`, `POST /update_weights` and `GET /health` over real HTTP on loopback.
Replies come from a `respond(prompt_text, rng) -> str` function, encoded with the model's
tokenizer and ended with `<|im_end|>` (finish "stop"), or cut at `max_tokens` (finish "length").
It can be told to fail: `fail_next` requests answer `fail_status`; `version_lag` makes it
report weight versions older than the loaded one. Run as a script it serves on a port until
killed, which is how tests make a server die mid-rollout.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

Respond = Callable[[str, random.Random], str]


def echo_last_line(prompt: str, rng: random.Random) -> str:
    """The last user message's text, as a deterministic default."""
    return prompt.rsplit("<|im_start|>user\n", 1)[-1].split("<|im_end|>", 1)[0]


class FakeBackend:
    def __init__(self, tokenizer: Any, respond: Respond = echo_last_line, delay_s: float = 0.0, seed: int = 0):
        self.tokenizer = tokenizer
        self.respond = respond
        self.delay_s = delay_s
        self.rng = random.Random(seed)
        self.version = 0
        self.version_lag = 0
        self.fail_next = 0
        self.fail_status = 503
        self.requests: list[dict[str, Any]] = []
        """Each generate request with `version` (loaded at arrival) and `time`."""
        self.updates: list[tuple[str, int]] = []
        self.update_delay_s = 0.0
        """How long `POST /update_weights` takes (a reload)."""
        self.transfer_calls: list[str] = []
        """The weight-transfer routes called (broadcast transport), in order."""
        self.in_flight = 0
        self.max_in_flight = 0
        self.eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")


def _record_call(backend: FakeBackend, route: str):
    async def record() -> dict:
        backend.transfer_calls.append(route)
        return {}

    return record


def make_app(backend: FakeBackend) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.post("/update_weights")
    async def update_weights(request: Request) -> dict:
        body = await request.json()
        if "update_info" in body:  # the broadcast transport: recorded, nothing received
            backend.transfer_calls.append("update_weights")
            return {}
        if backend.update_delay_s:
            await asyncio.sleep(backend.update_delay_s)
        backend.updates.append((body["path"], body["version"]))
        backend.version = body["version"]
        return {"weight_version": backend.version}

    for route in ("pause", "resume", "start_weight_update"):
        app.post(f"/{route}")(_record_call(backend, route))

    @app.post("/finish_weight_update")
    async def finish_weight_update(request: Request) -> dict:
        backend.version = int((await request.json())["weight_version"])
        backend.transfer_calls.append(f"finish {backend.version}")
        return {}

    @app.post("/v1/generate")
    async def generate(request: Request):
        body = await request.json()
        backend.requests.append({**body, "version": backend.version, "time": time.monotonic()})
        if backend.fail_next > 0:
            backend.fail_next -= 1
            return JSONResponse({"error": {"message": "injected failure", "type": "server_error"}},
                                status_code=backend.fail_status)
        backend.in_flight += 1
        backend.max_in_flight = max(backend.max_in_flight, backend.in_flight)
        try:
            if backend.delay_s:
                await asyncio.sleep(backend.delay_s)
            prompt = backend.tokenizer.decode(body["prompt_token_ids"])
            ids = backend.tokenizer.encode(backend.respond(prompt, backend.rng), add_special_tokens=False) + [backend.eos_id]
            finish = "stop"
            if len(ids) > body["max_tokens"]:
                ids, finish = ids[: body["max_tokens"]], "length"
            version = max(0, backend.version - backend.version_lag)
            choice = {"index": 0, "token_ids": ids, "logprobs": [-0.25] * len(ids),
                      "text": backend.tokenizer.decode(ids, skip_special_tokens=True), "finish_reason": finish,
                      "weight_version": version}
            return {"id": f"gen-{len(backend.requests)}", "prompt_token_ids": body["prompt_token_ids"],
                    "choices": [choice], "weight_version": version,
                    "usage": {"prompt_tokens": len(body["prompt_token_ids"]), "completion_tokens": len(ids)}}
        finally:
            backend.in_flight -= 1

    return app


class ServerThread:
    """Serves an app on a loopback port from a background thread."""

    def __init__(self, app: FastAPI):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))  # bound here and handed to uvicorn: no other process can take the port
        self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", loop="asyncio"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True, help="model folder whose tokenizer to use")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay-s", type=float, default=0.0)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    backend = FakeBackend(AutoTokenizer.from_pretrained(args.model), delay_s=args.delay_s)
    uvicorn.run(make_app(backend), host="127.0.0.1", port=args.port, log_level="warning", loop="asyncio")


if __name__ == "__main__":
    main()
