"""The default draft of the default model follows the device (the fleet benchmark's CPU winner)."""
import torch

from specfleet.llm import DEFAULT_MODEL, default_draft
from specfleet.strategies.spec_language import parse


def test_default_draft_per_device():
    assert default_draft(DEFAULT_MODEL, torch.device("cpu")) == "fleet(suffix,prompt-lookup,datastore)"
    assert default_draft(DEFAULT_MODEL, torch.device("cuda:0")) == "fleet(suffix,prompt-lookup)"
    assert default_draft(DEFAULT_MODEL, "cpu") == "fleet(suffix,prompt-lookup,datastore)"
    assert default_draft("smollm2-135m-instruct", torch.device("cpu")) is None
    # the default model by its alias gets the same default (it got none before: LLM("qwen-1.5b") was plain)
    assert default_draft("qwen-1.5b", torch.device("cpu")) == "fleet(suffix,prompt-lookup,datastore)"
    assert default_draft("Qwen-1.5B", "cpu") == "fleet(suffix,prompt-lookup,datastore)"
    assert default_draft("/some/path/model.gguf", "cpu") is None
    # a target without a tokenizer cannot tokenize the datastore's corpus: the same fleet without it
    assert default_draft(DEFAULT_MODEL, "cpu", with_tokenizer=False) == "fleet(suffix,prompt-lookup)"


def test_default_drafts_are_valid_specs():
    for device in ("cpu", "cuda"):
        assert parse(default_draft(DEFAULT_MODEL, torch.device(device))) is not None
