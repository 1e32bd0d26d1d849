"""`server.api_key`: every route of the app but `GET /health` needs `Authorization: Bearer <api_key>`.

The routes are listed from the app itself, FastAPI's own (`/openapi.json`, `/docs`, ...) included, so a route
added later is checked too.
"""

import httpx
import pytest
from fastapi.routing import iter_route_contexts
from inference_helpers import make_config

from tandem.inference.server import BackgroundServer

KEY = "sesame-3f9c"


@pytest.fixture(scope="module")
def guarded(tiny_dir):
    config = make_config(tiny_dir)
    config.server.api_key = KEY
    running = BackgroundServer(config)
    yield running
    running.stop()


def every_route(running: BackgroundServer) -> list[tuple[str, str]]:
    routes = iter_route_contexts(running.server.config.app.routes)  # routers' routes as the app serves them
    return sorted((method, route.path) for route in routes for method in route.methods)


def check_refused(response: httpx.Response) -> None:
    assert response.status_code == 401, (response.request.method, response.request.url, response.text)
    assert response.headers["www-authenticate"] == "Bearer"
    if response.request.method == "HEAD":
        return  # no body
    assert response.json()["error"] == {"message": "missing or wrong API key: send `Authorization: Bearer <api_key>`",
                                        "type": "authentication_error", "param": None, "code": 401}


def test_every_route_but_health_needs_the_key(guarded):
    routes = every_route(guarded)
    paths = {path for _, path in routes}
    assert {"/openapi.json", "/docs", "/redoc", "/v1/generate", "/update_weights", "/metrics"} <= paths, paths
    with httpx.Client(base_url=guarded.url, timeout=60) as client:
        for method, path in routes:
            if path == "/health":
                assert client.request(method, path).status_code in (200, 405)
                continue
            check_refused(client.request(method, path))
            check_refused(client.request(method, path, headers={"Authorization": f"Bearer {KEY}x"}))
            check_refused(client.request(method, path, headers={"Authorization": f"Basic {KEY}"}))
            answered = client.request(method, path, headers={"Authorization": f"bearer {KEY}"})  # any case of the scheme
            assert answered.status_code != 401, (method, path, answered.text)
        assert client.post("/resume", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        # A path the app lacks tells nothing without the key.
        check_refused(client.get("/no/such/route"))
        assert client.get("/no/such/route", headers={"Authorization": f"Bearer {KEY}"}).status_code == 404


def test_a_refused_body_is_not_read_and_the_connection_serves_on(guarded):
    with httpx.Client(base_url=guarded.url, timeout=60) as client:
        check_refused(client.post("/v1/generate", json={"prompt_token_ids": [1] * 50_000, "max_tokens": 2}))
        assert client.get("/health").status_code == 200
        answered = client.post("/v1/generate", json={"prompt_token_ids": [1, 2], "max_tokens": 2},
                               headers={"Authorization": f"Bearer {KEY}"})
        assert answered.status_code == 200 and len(answered.json()["choices"][0]["token_ids"]) <= 2


def test_the_openapi_document_declares_the_key(guarded, server):
    document = httpx.get(f"{guarded.url}/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert document["components"]["securitySchemes"]["bearer"] == {
        "type": "http", "scheme": "bearer", "description": "`server.api_key`: `Authorization: Bearer <api_key>`"}
    assert document["security"] == [{"bearer": []}]
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            if path == "/health":
                assert operation["security"] == [] and "401" not in operation["responses"], (method, path)
            else:
                assert "security" not in operation and "401" in operation["responses"], (method, path)
    # Without a key (the shared server) the document asks for none.
    open_document = httpx.get(f"{server.url}/openapi.json").json()
    assert "security" not in open_document and "securitySchemes" not in open_document.get("components", {})
    assert not any("401" in op["responses"] for ops in open_document["paths"].values() for op in ops.values())
