"""The CLI end to end: a real generation on SmolLM2, and one clear error (exit 2) per kind of bad input."""
import json

import pytest

from specfleet.cli import main
from tests.conftest import real_model_path


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_missing_model_path(capsys, tmp_path):
    code, _, err = run(capsys, "generate", "--model", str(tmp_path / "nope.gguf"), "--draft", "none", "--prompt", "hi")
    assert code == 2 and "neither an existing file" in err and "nope.gguf" in err


def test_corrupt_gguf(capsys, tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00garbage" * 50)
    code, _, err = run(capsys, "generate", "--model", str(bad), "--draft", "none", "--prompt", "hi")
    assert code == 2 and "broken.gguf" in err


def test_unsupported_architecture(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    code, _, err = run(capsys, "generate", "--model", str(tmp_path), "--draft", "none", "--prompt", "hi")
    assert code == 2 and "gpt2" in err and "unsupported" in err.lower()


def test_unknown_draft_name(capsys):
    path = real_model_path("smollm2-135m-instruct")
    code, _, err = run(capsys, "generate", "--model", str(path), "--draft", "no-such-draft", "--dtype", "float32",
                       "--prompt", "hi")
    assert code == 2 and "no-such-draft" in err


@pytest.mark.parametrize("flag,value,needle", [("--temperature", "-1", "temperature"), ("--top-p", "0", "top_p"),
                                               ("--max-tokens", "0", "max_tokens"), ("--top-k", "-7", "top_k")])
def test_invalid_sampling_parameters(capsys, flag, value, needle):
    code, _, err = run(capsys, "generate", "--draft", "none", "--prompt", "hi", flag, value)
    assert code == 2 and needle in err


@pytest.mark.real_model
def test_prompt_longer_than_context(capsys):
    path = real_model_path("smollm2-135m-instruct")
    code, _, err = run(capsys, "generate", "--model", str(path), "--draft", "none", "--dtype", "float32",
                       "--max-model-len", "128", "--kv-cache-mb", "16", "--no-chat", "--prompt", "word " * 300)
    assert code == 2 and "context holds" in err and "nothing is truncated" in err


@pytest.mark.real_model
def test_generate_streams_text_and_prints_stats(capsys, tmp_path):
    path = real_model_path("smollm2-135m-instruct")
    code, out, err = run(capsys, "generate", "--model", str(path), "--draft", "prompt-lookup", "--dtype", "float32",
                         "--quantization", "none", "--kv-cache-mb", "32", "--max-tokens", "12",
                         "--prompt", "What is the capital of France?")
    assert code == 0 and "Paris" in out
    assert "[spec]" in err and "mean accepted length" in err and "of the tokens judged)" in err
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Name a fruit.\nName a colour.\n")
    code, out, _ = run(capsys, "generate", "--model", str(path), "--draft", "none", "--dtype", "float32",
                       "--kv-cache-mb", "32", "--max-tokens", "8", "--prompts-file", str(prompts), "--json")
    lines = [json.loads(x) for x in out.strip().splitlines()]
    assert code == 0 and [x["prompt"] for x in lines] == ["Name a fruit.", "Name a colour."]
    assert all(x["text"] and x["finish_reason"] in ("stop", "length") for x in lines)
