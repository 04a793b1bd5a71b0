"""A streaming client that stops reading, over a real TCP connection to a real uvicorn server.

The kernel buffers between the two (the client's receive buffer, the server's send buffer, which Linux
grows to megabytes, and the transport's 64 KiB) take a whole stream of this size without the ASGI
`send` ever blocking, so the engine-side guard (a full stream buffer) never sees such a client. The
socket-side guard (server/stall.py) does: bytes wait and the client acknowledges none of them for
the stall limit -> its connection is closed and its request stopped; a client that reads, however
slowly, is served to the end. Linux only (TCP_INFO, SIOCOUTQ).
"""
from __future__ import annotations

import json
import socket
import sys
import threading
import time

import pytest

from specfleet.llm import LLM
from specfleet.server.app import ServerConfig, create_app
from tiny_models import LetterTokenizer, ours_from_hf, random_prompts, tiny_hf_model

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_INFO and SIOCOUTQ are Linux's")
uvicorn = pytest.importorskip("uvicorn")

STALL_S = 1.5  # above the ~0.56 s between window updates of a small-buffered client reading every 0.2 s
MAX_TOKENS = 400  # ~150 bytes of SSE a token: ~60 KB, which the socket buffers take whole


@pytest.fixture(scope="module")
def server():
    """A real uvicorn server on a loopback port, in its own thread; each engine step takes >= 10 ms, so
    the 400-token stream lasts seconds, several stall limits."""
    llm = LLM.from_model(ours_from_hf(tiny_hf_model("llama")), LetterTokenizer(), None, dtype="float32",
                         kv_cache_bytes=1 << 20, block_size=4)
    step = llm.engine.step

    def slow_step():
        time.sleep(0.01)
        return step()

    llm.engine.step = slow_step
    app = create_app(llm, ServerConfig("tiny", stream_stall_timeout_s=STALL_S))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    yield app, sock.getsockname()[1]
    srv.should_exit = True
    thread.join(30)


def stream_request(port: int) -> socket.socket:
    """A client with a small receive buffer that sends a long streamed completion request."""
    body = json.dumps({"prompt": random_prompts([6])[0], "max_tokens": MAX_TOKENS, "stream": True,
                       "temperature": 0, "ignore_eos": True}).encode()
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.connect(("127.0.0.1", port))
    client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                   b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return client


def metric(port: int, name: str) -> float:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        text = b"".join(iter(lambda: s.recv(65536), b"")).decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def wait_idle(app, timeout_s: float = 60) -> None:
    engine = app.state.engine
    deadline = time.monotonic() + timeout_s
    while engine.snapshot.num_requests or engine.num_queued:
        assert time.monotonic() < deadline, "the request is still running"
        time.sleep(0.02)


def test_a_client_that_never_reads_is_stopped_though_the_sockets_buffer_its_stream(server):
    app, port = server
    before = metric(port, "specfleet_stalled_streams_total")
    client = stream_request(port)
    try:
        time.sleep(0.3)  # the request is in the engine
        wait_idle(app)  # ... and gone again: stopped, or (the old guard) run to its end into the buffers
        assert metric(port, "specfleet_stalled_streams_total") == before + 1, \
            "a client that read nothing was not stopped: the kernel buffered its whole stream"
        # the server closed the connection (a reset: what it had buffered is dropped), mid-stream
        got = b""
        with pytest.raises(ConnectionResetError):
            while chunk := client.recv(65536):
                got += chunk
        assert b'"finish_reason": "length"' not in got and b"[DONE]" not in got
    finally:
        client.close()
    # the server goes on: a client that reads gets its whole stream
    reader = stream_request(port)
    try:
        text = read_to_done(reader)
    finally:
        reader.close()
    assert '"finish_reason": "length"' in text


def read_to_done(client: socket.socket, pause_s: float = 0.0, chunk: int = 65536) -> str:
    got = b""
    while b"data: [DONE]" not in got:
        if pause_s:
            time.sleep(pause_s)
        data = client.recv(chunk)
        assert data, "the server closed the stream before [DONE]"
        got += data
    return got.decode(errors="replace")


def test_a_slow_reader_that_keeps_reading_is_served_to_the_end(server):
    """Reads 2 KB every 0.2 s, slower than the stream arrives, so bytes always wait; but each read lets
    the client acknowledge more, which restarts the clock: never stopped."""
    app, port = server
    before = metric(port, "specfleet_stalled_streams_total")
    client = stream_request(port)
    try:
        text = read_to_done(client, pause_s=0.2, chunk=2048)
    finally:
        client.close()
    assert '"finish_reason": "length"' in text
    assert metric(port, "specfleet_stalled_streams_total") == before
    wait_idle(app)
