"""The native llama-server benchmark system (bench/llamacpp.py LlamaServerSystem) against a stand-in server:
the binary named by LLAMA_SERVER starts in its own process with none of our OMP/GOMP variables and with
LLAMA_SERVER_ARGS, greedy token-id prompts go to /completion streamed, tokens and TTFT come back, prefill
seconds are the server's own prompt timing, and the process is gone after close()."""
import json
import os
import sys
import textwrap

import pytest

from specfleet.bench import llamacpp
from specfleet.bench.systems import Settings, SystemSpec, parse_system

FAKE = textwrap.dedent('''
    import json, os, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    with open(os.environ["FAKE_LLAMA_LOG"], "w") as f:
        json.dump({"args": args, "omp": sorted(k for k in os.environ if k.startswith(("OMP_", "GOMP_")))}, f)

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert body["temperature"] == 0 and body["top_k"] == 1 and body["return_tokens"]
            # the stand-in keeps the last prompt; with cache_prompt the next one reuses the prefix they share
            last, self.server.last = getattr(self.server, "last", []), body["prompt"] if body["cache_prompt"] else []
            cache_n = next((i for i, (a, b) in enumerate(zip(last, body["prompt"])) if a != b),
                           min(len(last), len(body["prompt"]))) if body["cache_prompt"] else 0
            toks = [body["prompt"][-1] + 1 + i for i in range(body["n_predict"])]
            if not body["ignore_eos"] and 7 in toks:
                toks = toks[:toks.index(7) + 1]
            self.send_response(200)
            self.end_headers()
            if not body["stream"]:
                self.wfile.write(json.dumps({"tokens": toks, "timings": {"prompt_ms": 12.5}}).encode())
                return
            for i, t in enumerate(toks):
                last = i == len(toks) - 1
                chunk = {"tokens": [t], "stop": last}
                if last:
                    chunk["timings"] = {"cache_n": cache_n}
                if last and "--spec-type" in args:  # a speculating server counts its drafts in its timings
                    chunk["timings"].update({"draft_n": 2 * len(toks), "draft_n_accepted": len(toks) // 2})
                self.wfile.write(("data: " + json.dumps(chunk) + "\\n\\n").encode())
                self.wfile.flush()

    HTTPServer(("127.0.0.1", port), H).serve_forever()
''')


@pytest.fixture
def fake_server(tmp_path, monkeypatch):
    script = tmp_path / "llama-server"
    script.write_text(f"#!{sys.executable}\n" + FAKE)
    script.chmod(0o755)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    log = tmp_path / "seen.json"
    monkeypatch.setenv("LLAMA_SERVER", str(script))
    monkeypatch.setenv("LLAMA_SERVER_ARGS", "--no-repack")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # ours: must not reach the peer
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(log))
    return gguf, log


def test_the_native_server_runs_in_its_own_process_greedy_with_its_own_threading(fake_server):
    gguf, log = fake_server
    assert llamacpp.available() and llamacpp.native_server() is not None
    system = llamacpp.make_system(SystemSpec("llamacpp", "llamacpp"), str(gguf), eos_token_ids=(7,))
    try:
        assert isinstance(system, llamacpp.LlamaServerSystem)
        seen = json.loads(log.read_text())
        assert seen["omp"] == [] and "--no-repack" in seen["args"] and str(gguf) in seen["args"]
        assert system.notes["args"] == ["--no-repack"] and "native" in system.notes["runs"]
        gen = system.generate([[1, 2, 3]], Settings(max_tokens=5, ignore_eos=True))[0]
        assert gen.output_ids == [4, 5, 6, 7, 8] and gen.ttft_s is not None and gen.latency_s >= gen.ttft_s
        assert gen.spec["cached_tokens"] == 0
        again = system.generate([[1, 2, 3, 4]], Settings(max_tokens=2, ignore_eos=True))[0]
        assert again.spec["cached_tokens"] == 0  # cold: every prompt from an empty cache (cache_prompt false)
        stopped = system.generate([[1, 2, 3]], Settings(max_tokens=5, ignore_eos=False))[0]
        assert stopped.output_ids == [4, 5, 6, 7]  # the eos token ends it
        assert system.prefill_seconds([1, 2, 3]) == pytest.approx(0.0125)
        with pytest.raises(Exception, match="greedy only"):
            system.generate([[1]], Settings(max_tokens=2, temperature=0.7))
    finally:
        system.close()
    assert system.proc.poll() is not None


def test_a_server_that_dies_at_start_is_a_clear_error(tmp_path, monkeypatch):
    script = tmp_path / "llama-server"
    script.write_text("#!/bin/sh\necho 'error: unknown argument' >&2\nexit 3\n")
    script.chmod(0o755)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    monkeypatch.setenv("LLAMA_SERVER", str(script))
    with pytest.raises(Exception, match="exited with 3.*unknown argument"):
        llamacpp.make_system(SystemSpec("llamacpp", "llamacpp"), str(gguf), eos_token_ids=(7,))


def test_the_server_speculates_with_the_spec_type_and_draft_it_is_given(fake_server):
    gguf, log = fake_server
    spec = parse_system(f"llamacpp:draft-simple,draft_model={str(gguf)!r}")
    system = llamacpp.make_system(spec, str(gguf), eos_token_ids=(7,))
    try:
        args = json.loads(log.read_text())["args"]
        at = args.index("--spec-type")
        assert args[at:at + 4] == ["--spec-type", "draft-simple", "-md", str(gguf)] and "--no-repack" in args
        assert system.notes["speculation"] == ["--spec-type", "draft-simple", "-md", str(gguf)]
        gen = system.generate([[1, 2, 3]], Settings(max_tokens=9, ignore_eos=True))[0]
        # the stand-in drafted 18 and accepted 4 of 9 tokens: 1 from the prefill, 4 steps made the other 8
        assert gen.output_ids == list(range(4, 13))
        assert gen.spec == {"steps": 4, "drafted": 18, "accepted": 4, "cached_tokens": 0}
    finally:
        system.close()


def test_a_loop_part_lets_the_server_reuse_the_prompt_it_cached(fake_server):
    gguf, _ = fake_server
    system = llamacpp.make_system(SystemSpec("llamacpp", "llamacpp"), str(gguf), eos_token_ids=(7,),
                                  cache_prompt=True)
    try:
        system.generate([[1, 2, 3]], Settings(max_tokens=1, ignore_eos=True))
        gen = system.generate([[1, 2, 3, 9, 9]], Settings(max_tokens=2, ignore_eos=True))[0]
        assert gen.spec["cached_tokens"] == 3 and gen.output_ids == [10, 11]
        assert system.prefill_seconds([1, 2, 3]) == pytest.approx(0.0125)  # the prefill figure stays cold
    finally:
        system.close()
