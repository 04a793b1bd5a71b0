"""The default draft of the default model follows the device (the fleet benchmark's CPU winner), and on the CPU
holds the 0.5B only where it is installed."""
import pytest
import torch

from specfleet import registry
from specfleet.llm import DEFAULT_MODEL, default_draft
from specfleet.strategies.spec_language import parse

WEIGHTLESS = "fleet(suffix,prompt-lookup,datastore)"
WITH_05B = "fleet(suffix,prompt-lookup,datastore,qwen-0.5b[quant=q4_0])"


@pytest.mark.parametrize("installed", [True, False])
def test_default_draft_per_device(monkeypatch, installed):
    real = registry.is_installed
    monkeypatch.setattr(registry, "is_installed",
                        lambda name: installed if registry.lookup(name).name.endswith("0.5b-instruct") else real(name))
    cpu = WITH_05B if installed else WEIGHTLESS
    assert default_draft(DEFAULT_MODEL, torch.device("cpu")) == cpu
    assert default_draft(DEFAULT_MODEL, torch.device("cuda:0")) == "fleet(suffix,prompt-lookup)"
    assert default_draft(DEFAULT_MODEL, "cpu") == cpu
    assert default_draft("smollm2-135m-instruct", torch.device("cpu")) is None
    # the default model by its alias gets the same default (it got none before: LLM("qwen-1.5b") was plain)
    assert default_draft("qwen-1.5b", torch.device("cpu")) == cpu
    assert default_draft("Qwen-1.5B", "cpu") == cpu
    assert default_draft("/some/path/model.gguf", "cpu") is None
    # a target without a tokenizer cannot tokenize the datastore's corpus: the same fleet without it
    assert default_draft(DEFAULT_MODEL, "cpu", with_tokenizer=False) == cpu.replace(",datastore", "")


def test_default_drafts_are_valid_specs():
    for device in ("cpu", "cuda"):
        assert parse(default_draft(DEFAULT_MODEL, torch.device(device))) is not None
