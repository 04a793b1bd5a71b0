"""The default draft of the default model follows the device (the fleet benchmark's CPU winner)."""
import torch

from specfleet.llm import DEFAULT_MODEL, default_draft
from specfleet.strategies.grammar import parse


def test_default_draft_per_device():
    assert default_draft(DEFAULT_MODEL, torch.device("cpu")) == "fleet(suffix,prompt-lookup)"
    assert default_draft(DEFAULT_MODEL, torch.device("cuda:0")) == "qwen2.5-coder-0.5b-instruct"
    assert default_draft(DEFAULT_MODEL, "cpu") == "fleet(suffix,prompt-lookup)"
    assert default_draft("smollm2-135m-instruct", torch.device("cpu")) is None


def test_default_drafts_are_valid_specs():
    for device in ("cpu", "cuda"):
        assert parse(default_draft(DEFAULT_MODEL, torch.device(device))) is not None
