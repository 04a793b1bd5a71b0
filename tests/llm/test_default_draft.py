"""The default draft of the default model follows the device (the fleet benchmark's CPU winner), and on the CPU
holds the 0.5B only where it is installed and the kernels have an integer dot-product path (not on AVX2)."""
import pytest
import torch

from specfleet import llm as llm_mod, registry
from specfleet.llm import DEFAULT_MODEL, default_draft
from specfleet.strategies.spec_language import parse

WEIGHTLESS = "fleet(suffix,prompt-lookup,datastore)"
WITH_05B = "fleet(suffix,prompt-lookup,datastore,qwen-0.5b[quant=q4_0])"


@pytest.mark.parametrize("installed", [True, False])
def test_default_draft_per_device(monkeypatch, installed):
    monkeypatch.setattr(llm_mod, "_kernel_path", lambda: "avx512vnni")
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


@pytest.mark.parametrize("path, with_model", [("avx2", False), ("avx512vnni", True), ("avxvnni", True),
                                              ("neondot", True), (None, True)])
def test_the_cpu_default_leaves_the_05b_out_on_the_avx2_path(monkeypatch, path, with_model):
    monkeypatch.setattr(registry, "is_installed", lambda name: True)
    monkeypatch.setattr(llm_mod, "_kernel_path", lambda: path)
    assert default_draft(DEFAULT_MODEL, "cpu") == (WITH_05B if with_model else WEIGHTLESS)
    assert default_draft(DEFAULT_MODEL, "cuda") == "fleet(suffix,prompt-lookup)"  # the device's, whatever the CPU


def test_the_kernel_path_is_this_process_choice(monkeypatch):
    monkeypatch.setenv("SPECFLEET_ISA", "generic")
    assert llm_mod._kernel_path() == "generic"
    monkeypatch.setenv("SPECFLEET_ISA", "no-such-path")
    assert llm_mod._kernel_path() is None
