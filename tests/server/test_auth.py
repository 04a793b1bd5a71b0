"""--api-key and --allowed-origins, in-process on a tiny random model: every route but /health needs
the bearer key (401 in the OpenAI error shape otherwise), and browsers from allowed origins pass CORS
preflights without it."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from specfleet.llm import LLM
from specfleet.server.app import ServerConfig, create_app
from tiny_models import ours_from_hf, random_prompts, tiny_hf_model

KEY = "sk-test-0123456789"
ORIGIN = "https://ui.example.com"
BODY = {"prompt": random_prompts([6])[0], "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def llm() -> LLM:
    model = ours_from_hf(tiny_hf_model("llama"))
    return LLM.from_model(model, None, None, dtype="float32", kv_cache_bytes=1 << 20, block_size=4)


@pytest.fixture(scope="module")
def client(llm):
    with TestClient(create_app(llm, ServerConfig("tiny", api_key=KEY, allowed_origins=(ORIGIN,)))) as c:
        yield c


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize("method,path", [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                                         ("GET", "/v1/models"), ("GET", "/v1/models/tiny"), ("GET", "/metrics"),
                                         ("POST", "/tokenize"), ("GET", "/no/such/route")])
@pytest.mark.parametrize("headers", [{}, bearer("sk-wrong"), {"Authorization": KEY}, bearer(KEY + "x"),
                                     {"Authorization": "Basic " + KEY}])
def test_routes_need_the_key(client, method, path, headers):
    r = client.request(method, path, json=BODY if method == "POST" else None, headers=headers)
    assert r.status_code == 401, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error" and "Bearer" in err["message"]
    assert r.headers["www-authenticate"] == "Bearer"


def test_the_key_opens_every_route_and_health_needs_none(client):
    assert client.post("/v1/completions", json=BODY, headers=bearer(KEY)).status_code == 200
    assert client.post("/v1/completions", json=BODY, headers={"Authorization": f"bearer {KEY}"}).status_code == 200
    assert client.get("/v1/models", headers=bearer(KEY)).json()["data"][0]["id"] == "tiny"
    assert "specfleet_requests_total" in client.get("/metrics", headers=bearer(KEY)).text
    assert client.get("/health").status_code == 200 and client.head("/health").status_code == 200


def test_no_key_configured_means_open():
    model = ours_from_hf(tiny_hf_model("llama"))  # its own engine: the module's app is still running on `llm`
    llm = LLM.from_model(model, None, None, dtype="float32", kv_cache_bytes=1 << 20, block_size=4)
    with TestClient(create_app(llm, ServerConfig("tiny"))) as c:
        assert c.post("/v1/completions", json=BODY).status_code == 200
        r = c.options("/v1/completions", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in r.headers  # no origins configured: no CORS


def test_cors_preflight_from_an_allowed_origin(client):
    r = client.options("/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert r.status_code == 200, r.text  # no key needed: browsers send preflights without credentials
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()


def test_cors_refuses_other_origins_and_labels_real_responses(client):
    r = client.options("/v1/completions", headers={"Origin": "https://evil.example",
                                                   "Access-Control-Request-Method": "POST"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = client.post("/v1/completions", json=BODY, headers={**bearer(KEY), "Origin": ORIGIN})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = client.post("/v1/completions", json=BODY, headers={"Origin": ORIGIN})  # a browser can read the 401
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN
