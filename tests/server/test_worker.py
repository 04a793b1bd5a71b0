"""The routes a router reads from a replica (server/worker.py), in-process on a tiny random model."""
from __future__ import annotations

from fastapi.testclient import TestClient

from specfleet.llm import LLM
from specfleet.server.app import ServerConfig, create_app
from specfleet.server.worker import REQUEST_EXIT
from tiny_models import ours_from_hf, tiny_hf_model


def tiny_llm() -> LLM:
    model = ours_from_hf(tiny_hf_model("llama"))
    return LLM.from_model(model, None, "suffix", dtype="float32", kv_cache_bytes=1 << 20, block_size=4)


def test_server_info_and_loads_follow_the_engine():
    llm = tiny_llm()
    with TestClient(create_app(llm, ServerConfig("tiny", max_queue=7))) as client:
        info = client.get("/server_info").json()
        assert info["model"] == "tiny" and info["max_queue"] == 7 and info["draft"] == "suffix"
        assert info["context_length"] == info["max_model_len"] == llm.engine.max_model_len
        assert info["kv_cache"]["num_blocks"] == llm.engine.blocks.num_blocks
        report = client.get("/v1/loads").json()
        assert report["dp_rank_count"] == 1 and not report["specfleet"]["draining"]
        before = report["loads"][0]
        assert all(isinstance(v, (int, float)) for v in before.values()), before  # what smg parses
        assert before["max_total_num_tokens"] == info["kv_cache"]["num_blocks"] * info["kv_cache"]["block_size"]
        assert before["num_running_reqs"] == before["num_waiting_reqs"] == 0 and before["token_usage"] == 0.0
        prompt = list(range(5, 45))
        for _ in range(2):  # the second request finds the first one's prompt blocks cached
            r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200, r.text
        report = client.get("/v1/loads").json()
        after, own = report["loads"][0], report["specfleet"]
        assert own["prefix_queried_tokens"] >= 2 * len(prompt) - 2 and own["prefix_hit_tokens"] > 0
        assert 0.0 < after["cache_hit_rate"] <= 0.5


def test_drain_needs_a_server_that_can_stop_itself():
    llm = tiny_llm()
    app = create_app(llm, ServerConfig("tiny"))
    with TestClient(app) as client:
        r = client.post("/drain")
        assert r.status_code == 501 and r.json()["error"]["code"] == "drain_unavailable"
        asked = []
        setattr(app.state, REQUEST_EXIT, lambda: asked.append(True))
        r = client.post("/drain")
        assert r.status_code == 202 and r.json()["status"] == "draining" and asked == [True]


def test_worker_routes_need_the_api_key_when_one_is_set():
    with TestClient(create_app(tiny_llm(), ServerConfig("tiny", api_key="k"))) as client:
        assert client.post("/drain").status_code == 401
        assert client.get("/v1/loads").status_code == 401
        assert client.get("/v1/loads", headers={"Authorization": "Bearer k"}).status_code == 200
