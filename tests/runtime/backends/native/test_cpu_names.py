"""The AMD core generation a report names from /proc/cpuinfo's family and model (build.amd_core_name): "AMD EPYC"
alone does not tell a Zen 2 from a Zen 3 or Zen 4, and the three run the AVX2 rows at different costs."""
import pytest

from specfleet.runtime.backends.native import build as native


@pytest.mark.parametrize("family, model, flags, name", [
    (23, 49, {"avx2"}, "Zen 2"),             # EPYC 7002 (Rome): one vector integer multiply a cycle
    (23, 113, {"avx2"}, "Zen 2"),            # Ryzen 3000 (Matisse)
    (23, 1, {"avx2"}, "Zen/Zen+"),           # EPYC 7001 (Naples)
    (25, 1, {"avx2"}, "Zen 3"),              # EPYC 7003 (Milan)
    (25, 17, {"avx2", "avx512f"}, "Zen 4"),  # EPYC 9004 (Genoa)
    (26, 2, {"avx2", "avx512f"}, "Zen 5"),
    (6, 143, {"avx2", "avx512f"}, None),     # not an AMD family: no name
])
def test_amd_core_generation_by_family_and_model(family, model, flags, name):
    assert native.amd_core_name(family, model, frozenset(flags)) == name


def test_this_machine_is_named_with_its_generation_where_amd_tells_it():
    text = native.cpu_family_model()
    assert text == "unknown" or text.startswith("family ")
    fam = native.cpu_family()
    if native.cpu_vendor() == "AuthenticAMD" and fam in (23, 25, 26):
        assert text.endswith(("Zen 2", "Zen/Zen+", "Zen 3", "Zen 4", "Zen 5")), text
    else:
        assert "Zen" not in text, text
