"""The start-up wait every benchmark, tool and test server goes through (specfleet/bench/startup.py)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from specfleet.bench.startup import ServerStartError, logged_url, wait_healthy


def test_a_process_that_exits_is_reported_with_its_log():
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    with pytest.raises(ServerStartError, match="exited with 3 during start-up: the log"):
        wait_healthy(proc, "http://127.0.0.1:9", 30, lambda: "the log")


def test_a_process_that_never_answers_is_killed_at_the_deadline():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with pytest.raises(ServerStartError, match="did not answer /health within 1 s"):
        wait_healthy(proc, "http://127.0.0.1:9", 1, poll_s=0.05)
    assert proc.wait(timeout=10) != 0  # killed


def test_the_url_a_server_logs_is_found_once_written(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("starting\n")
    find = logged_url(log)
    assert find() == ""
    log.write_text("starting\nINFO: serving on http://127.0.0.1:43117 (2 threads)\n")
    assert find() == "http://127.0.0.1:43117"
