"""The build side of specfleet's native CPU code: which C sources build, with which flags, on which machine.

`compile_library` compiles C sources with the system C compiler into `<cache root>/native/` and loads
them with ctypes: no torch headers, so a build takes seconds. OpenMP is linked by soname
(`libgomp.so.1`), which resolves to the copy torch has already loaded, so both share one thread pool
runtime. The library's name carries a hash of the sources, the headers and the build command, so an
edited kernel is rebuilt; builds go to a temporary file renamed into place, so concurrent processes never
load a half-written library. runtime/backends/native/kernels.py is the one loader of the kernels it builds.
`cpu_flags` is the one reader of the CPU's flags.

The kernels' wrappers (and the choice of sources and flags per ISA path) live in runtime/backends/native/kernels.py.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

_cpu_flags: frozenset[str] | None = None


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (`avx2`, `avx512_vnni`, ...; ARM's `Features`
    too), read once: the one place the kernels' builds and the benchmark reports learn the ISA."""
    global _cpu_flags
    if _cpu_flags is None:
        try:
            line = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines()
                         if ln.startswith(("flags", "Features"))), "")
        except OSError:
            line = ""
        _cpu_flags = frozenset(line.split(":", 1)[1].split() if ":" in line else ())
    return _cpu_flags


def _cpuinfo(field: str) -> str:
    """The first value /proc/cpuinfo gives for `field` (`vendor_id`, `cpu family`, `model`); "" where it gives none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip() == field:
                return value.strip()
    except OSError:
        pass
    return ""


def cpu_vendor() -> str:
    """The CPU's vendor as /proc/cpuinfo names it (`GenuineIntel`, `AuthenticAMD`; "" where it says none)."""
    return _cpuinfo("vendor_id")


def cpu_family() -> int | None:
    """The CPU's family number as /proc/cpuinfo gives it (AMD: 25 for Zen 3 and Zen 4, 26 for Zen 5); None where
    it gives none."""
    value = _cpuinfo("cpu family")
    return int(value) if value.isdigit() else None


def amd_core_name(family: int, model: int, flags: frozenset[str] | set[str]) -> str | None:
    """The AMD core generation of (family, model), where the numbers tell it: family 23 models 0x30 and up are Zen 2
    (Rome is model 49), below Zen or Zen+; family 25 is Zen 3, or Zen 4 where the CPU has AVX512 (both share the
    family); family 26 is Zen 5. None for other families. A Zen 2 issues one vector integer multiply a cycle
    (vpmaddubsw and vpmaddwd share a pipe: benchmarks/kernels/ports.py), which bounds its AVX2 verification rows."""
    if family == 23:
        return "Zen 2" if model >= 0x30 else "Zen/Zen+"
    if family == 25:
        return "Zen 4" if "avx512f" in flags else "Zen 3"
    if family == 26:
        return "Zen 5"
    return None


def cpu_family_model() -> str:
    """"family F model M" (a model name such as "AMD EPYC" does not tell a Zen 2 from a Zen 3 or Zen 4), with the
    AMD core generation where the numbers tell it ("family 23 model 49, Zen 2"); "unknown" where /proc/cpuinfo gives
    neither."""
    family, model = _cpuinfo("cpu family"), _cpuinfo("model")
    if not (family and model):
        return "unknown"
    amd = cpu_vendor() == "AuthenticAMD" and family.isdigit() and model.isdigit()
    core = amd_core_name(int(family), int(model), cpu_flags()) if amd else None
    return f"family {family} model {model}" + (f", {core}" if core else "")


def _cpu_has_avx2_fma() -> bool:
    return {"avx2", "fma"} <= cpu_flags()


_BUILD_TIMEOUT_S = 900  # per compile: a loaded 2-core machine took 120+ s over the largest body once


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.strip()[-2000:]}")


def _build(out: Path, compiler: str, sources: list[Path], flags: list[str]) -> None:
    """Compile each source to an object at once (one compiler per core), then link them into `out`: the
    bodies' files dominate, and one command over all of them compiled them one after another."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(dir=out.parent) as objdir:
            objects = [str(Path(objdir) / f"{i}-{s.stem}.o") for i, s in enumerate(sources)]
            compile_flags = [f for f in flags if not f.startswith(("-l", "-shared"))]
            libs = [f for f in flags if f.startswith("-l")]
            jobs = [[compiler, *compile_flags, "-c", str(s), "-o", o] for s, o in zip(sources, objects)]
            with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
                for future in [pool.submit(_run, cmd) for cmd in jobs]:
                    future.result()
            _run([compiler, *(f for f in flags if f not in libs), *objects, *libs, "-o", tmp])
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


class Library(ctypes.CDLL):
    """A loaded kernel library: one per process and build, so a copied model (copy.deepcopy) shares it
    rather than failing to copy the handle (ctypes cannot copy function pointers)."""

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


def compile_library(source: Path | list[Path], flags: list[str], headers: tuple[Path, ...] = ()) -> ctypes.CDLL:
    """Build `source` (one C file, or several linked into one library) into `<cache root>/native/`
    (named by a hash of the sources, the `headers` they include and the command, so an edited kernel is
    rebuilt; in the temp directory if the cache is read-only) and load it. Raises with the reason where
    it cannot (see `missing_prerequisite`)."""
    missing = missing_prerequisite("generic")  # the switch, the system, a compiler; the CPU is the caller's
    if missing is not None:
        raise RuntimeError(missing)
    sources = [source] if isinstance(source, Path) else list(source)
    compiler = _compiler()
    from specfleet.registry import cache_root

    digest = hashlib.sha256(" ".join([compiler, *flags]).encode())
    for path in [*sources, *headers]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    name = f"{sources[0].stem}-{digest.hexdigest()[:16]}.so"
    path = cache_root() / "native" / name
    if not path.exists():
        try:
            _build(path, compiler, sources, flags)
        except OSError:  # the cache is not writable (a read-only home): build in the temp directory
            path = Path(tempfile.gettempdir()) / f"specfleet-native-{os.getuid()}" / name
            if not path.exists():
                _build(path, compiler, sources, flags)
    return Library(str(path))


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def machine_family() -> str | None:
    """The kernels' architecture family of this machine: "x86" (x86-64), "arm" (aarch64), None (neither)."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        return "x86"
    if machine in ("aarch64", "arm64"):
        return "arm"
    return None


def missing_prerequisite(family: str | None = None) -> str | None:
    """Why the kernels of `family` cannot be built and run here, in one line, before trying (None: they
    should). `family`: "x86", "arm" or "generic" (plain C, any CPU); default this machine's own family."""
    if os.environ.get("SPECFLEET_NATIVE", "1").lower() in ("0", "false", "no", "off"):
        return "turned off by SPECFLEET_NATIVE=0"
    system, machine = platform.system(), platform.machine()
    if system != "Linux":
        return f"the native kernels are built on Linux only (x86-64 with AVX2, aarch64 with the dot product), this is {system} {machine}"
    own = machine_family()
    if family is None:
        if own is None:
            return f"no native kernel path for {machine} (x86-64 with AVX2, aarch64 with the dot product)"
        family = own
    if family != "generic":
        if family != own:
            return f"the {family} kernels do not run on {machine}"
        if family == "x86" and not _cpu_has_avx2_fma():
            return "this CPU lacks AVX2 or FMA"
        if family == "arm" and "asimddp" not in cpu_flags():
            return "this ARM CPU lacks the dot product extension (no asimddp in /proc/cpuinfo)"
    if _compiler() is None:
        return "no C compiler found (set CC, or install gcc)"
    return None
