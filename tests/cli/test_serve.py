"""`specfleet serve`'s options that shape the app: --api-key / SPECFLEET_API_KEY, --allowed-origins,
--chat-template. Only argument parsing and ServerConfig: no model is loaded."""
from __future__ import annotations

import argparse

import pytest

from specfleet.cli.serve import API_KEY_ENV, add_serve_args, server_config


def config(*argv: str, env: dict[str, str] | None = None):
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return server_config(parser.parse_args(["--model", "m", *argv]), env or {})


def test_api_key_from_flag_or_environment():
    assert config().api_key is None
    assert config("--api-key", "sk-flag").api_key == "sk-flag"
    assert config(env={API_KEY_ENV: "sk-env"}).api_key == "sk-env"
    assert config("--api-key", "sk-flag", env={API_KEY_ENV: "sk-env"}).api_key == "sk-flag"
    assert config(env={API_KEY_ENV: ""}).api_key is None  # an empty variable does not lock the server


def test_allowed_origins_comma_separated_or_repeated():
    assert config().allowed_origins == ()
    got = config("--allowed-origins", "https://a.example, https://b.example", "--allowed-origins", "http://c:3000")
    assert got.allowed_origins == ("https://a.example", "https://b.example", "http://c:3000")
    assert config("--allowed-origins", "*").allowed_origins == ("*",)


def test_chat_template_file_is_read_and_checked(tmp_path):
    from specfleet.errors import SpecfleetError

    good = tmp_path / "t.jinja"
    good.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert config("--chat-template", str(good)).chat_template == good.read_text()
    assert config().chat_template is None
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    with pytest.raises(SpecfleetError, match="not a valid Jinja template"):
        config("--chat-template", str(broken))
    with pytest.raises(SpecfleetError, match="cannot read --chat-template"):
        config("--chat-template", str(tmp_path / "missing.jinja"))
