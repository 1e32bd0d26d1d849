"""One large request stalls no one: bodies over the limit are refused unread, CPU work runs off the event loop.

The server is `tandem inference` in its own process, as deployed: a server in a thread of the test process
shares the interpreter lock and the garbage collector with everything the test session has built (there, one
health answer took 0.32 s in CI; the cause was not traced)."""

import gc
import json
import threading
import time

import httpx
import pytest
from local_servers import tandem_inference

from tandem.config.inference import ServerConfig
from tandem.inference.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest

LIMIT = ServerConfig().max_request_bytes

pytestmark = pytest.mark.alone  # latencies of 0.1 s and 1 s: another test computing beside them would blur them


@pytest.fixture(scope="module")
def server_url(tiny_dir, tmp_path_factory):
    with tandem_inference(tiny_dir, tmp_path_factory.mktemp("body_limit") / "inference.log",
                          "--engine.num-blocks", "64", "--engine.max-model-len", "512") as (url, _):
        yield url


def health_latencies_during(url: str, request) -> tuple[list[float], httpx.Response, float]:
    """Latencies of `GET /health` polled while `request()` runs in a thread; its response and duration.

    The test process's garbage collector is paused meanwhile: a full collection of pytest's heap stops every
    thread of this process, and would be timed as the server's latency."""
    done: dict = {}

    def run() -> None:
        start = time.monotonic()
        done["response"] = request()
        done["seconds"] = time.monotonic() - start

    latencies = []
    gc.collect()
    gc.disable()
    try:
        with httpx.Client(base_url=url, timeout=10) as client:
            client.get("/health")  # connected before the clock starts
            worker = threading.Thread(target=run)
            worker.start()
            while worker.is_alive():
                start = time.monotonic()
                assert client.get("/health").status_code == 200
                latencies.append(time.monotonic() - start)
                time.sleep(0.01)
            worker.join()
    finally:
        gc.enable()
    return latencies, done["response"], done["seconds"]


def maximal(body: dict, item: str) -> bytes:
    """`body` with its "@" grown into a text or a list of token ids until the JSON is as long as the limit allows."""
    head, tail = json.dumps(body).split('"@"')
    room = LIMIT - len(head) - len(tail) - 2
    if item == "text":
        return f'{head}"{"ab c" * (room // 4)}"{tail}'.encode()
    return f'{head}[{",".join(["1"] * (room // 2))}]{tail}'.encode()


def parse_seconds(raw: bytes, model) -> float:
    """The fastest of three parses of `raw` into `model`, as the server parses a body: the work that holds its event
    loop by design (`server.max_request_bytes` says how long), timed on this machine at this moment."""
    times = []
    for _ in range(3):
        start = time.perf_counter()
        model.model_validate(json.loads(raw))
        times.append(time.perf_counter() - start)
    return min(times)


@pytest.mark.parametrize("path, body, item, model", [
    ("/v1/completions", {"model": "MODEL", "max_tokens": 1, "prompt": "@"}, "text", CompletionRequest),
    ("/v1/chat/completions", {"model": "MODEL", "max_tokens": 1, "messages": [{"role": "user", "content": "@"}]}, "text",
     ChatCompletionRequest),
    ("/v1/generate", {"max_tokens": 1, "prompt_token_ids": "@"}, "ids", GenerateRequest),
], ids=["text-prompt", "chat-message", "token-ids"])
def test_health_waits_for_no_more_than_the_parse_of_a_maximal_request(server_url, tiny_dir, path, body, item, model):
    """Tokenizing, templating and checking a maximal prompt run off the event loop; only the body's parse holds it.

    The bound is 0.1 s plus twice the parse timed here, so that it follows the machine's speed; tokenizing a
    maximal text on the loop would hold it for most of the request, many times its parse."""
    raw = maximal({k: str(tiny_dir) if v == "MODEL" else v for k, v in body.items()}, item)
    assert LIMIT - 16 < len(raw) <= LIMIT
    bound = 0.1 + 2 * parse_seconds(raw, model)
    latencies, response, seconds = health_latencies_during(
        server_url, lambda: httpx.post(f"{server_url}{path}", content=raw, headers={"content-type": "application/json"}, timeout=60))
    assert response.status_code == 400 and "context" in response.json()["error"]["message"], response.text[:300]
    assert max(latencies) < bound, (max(latencies), bound, seconds)


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_over_the_limit_is_refused_before_it_is_read(server_url, chunked):
    raw = b'{"prompt_token_ids": [' + b"1," * LIMIT + b'1], "max_tokens": 1}'
    content = (raw[i:i + 65536] for i in range(0, len(raw), 65536)) if chunked else raw
    start = time.monotonic()
    response = httpx.post(f"{server_url}/v1/generate", content=content, headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == 413, response.text[:300]
    error = response.json()["error"]
    assert f"larger than this server's limit of {LIMIT} bytes (`server.max_request_bytes`)" in error["message"]
    assert error["type"] == "invalid_request_error" and error["code"] == 413
    assert time.monotonic() - start < 1.0
