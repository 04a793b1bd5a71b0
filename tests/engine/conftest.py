"""The engine tests' shared setup: one tiny random Qwen2 target and a perturbed copy of it as the draft
(acceptance is high but not total), built once per module as each file used to build its own."""
import pytest

from tiny_models import ours_from_hf, perturbed_copy, tiny_hf_model


@pytest.fixture(scope="module")
def target():
    return ours_from_hf(tiny_hf_model("qwen2"))


@pytest.fixture(scope="module")
def draft(target):
    return perturbed_copy(target, 0.15)
