"""The soak test's short form (tools/soak.py, issue 31): the real SmolLM2 server on loopback, 6
clients for 25 s with streams, disconnects, slow readers, abandoned requests, multi-turn conversations
and canaries, and a draft source that raises on 5 % of its calls. Passes when the server's RSS is flat
after warm-up, no KV block is held at the end, the engine never died, every response is complete or a
clear error, the requests hit by draft failures completed by plain decoding, and every canary answer is
the same. The 10-minute form is run by hand (`python tools/soak.py --minutes 10`)."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.conftest import real_model_path

SOAK = Path(__file__).resolve().parents[2] / "tools" / "soak.py"


def load_soak():
    spec = importlib.util.spec_from_file_location("soak", SOAK)
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.real_model
def test_short_soak_holds_up():
    real_model_path("smollm2-135m-instruct")
    soak = load_soak()
    args = soak.parse_args(["--minutes", "0.42", "--clients", "6", "--max-tokens", "24", "--turns", "4",
                            "--max-model-len", "1024", "--kv-cache-mb", "64", "--fail-rate", "0.05",
                            "--sample-every", "1", "--warmup", "0.4", "--no-write"])
    result = soak.soak(args)
    summary = {k: result[k] for k in ("checks", "requests", "by_status", "errors", "unclear", "rss_mib",
                                      "responses_hit_by_draft_failures", "canaries")}
    print(json.dumps(summary))
    assert result["passed"], json.dumps(summary, indent=1) + "\n" + "\n".join(result["server_log_tail"])
    assert result["requests"] >= 30, summary  # enough traffic to mean something
    for scenario in ("stream", "disconnect", "slow", "chat", "canary"):
        assert result["by_scenario"].get(scenario), f"{scenario} never ran: {summary}"
