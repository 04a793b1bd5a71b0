"""Every benchmark run writes its figures as JSON plus a Markdown summary under benchmarks/results/,
naming the command, machine, device, dtype and library versions, so the README can quote them."""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import shlex
import sys
from pathlib import Path

import torch

RESULTS_DIR = Path(os.environ.get("SPECFLEET_RESULTS_DIR", Path(__file__).resolve().parents[2] / "benchmarks" / "results"))


def machine_info(device: str = "cpu") -> dict:
    from specfleet.runtime.backends.native.build import cpu_family_model

    info = {
        "hostname_class": platform.machine(),
        "cpu": _cpu_name(),
        "cpu_family_model": cpu_family_model(),
        "isa": cpu_isa(),
        "kernel_isa": kernel_isa(),
        "kernel_tuning": kernel_tuning(),
        "cpu_count": os.cpu_count(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset (OpenMP default)"),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "unset"),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": device,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16",
             "amx_tile", "asimd", "asimddp")


def cpu_isa() -> list[str]:
    """The instruction-set flags that decide which kernels run (from /proc/cpuinfo): every figure names them,
    since this project's machines differ (AVX2-only Zen 3, AVX512-VNNI Zen 4) and users' CPUs more."""
    from specfleet.runtime.backends.native.build import cpu_flags

    have = cpu_flags()
    return [f for f in ISA_FLAGS if f in have]


def kernel_isa() -> str:
    """The ISA path of the GGUF block-format kernels in this process (runtime/formats/qtensor.py), or why none runs."""
    from specfleet.runtime.backends.native import kernels as native_backend

    try:
        return native_backend.isa() or f"none ({native_backend.unavailable_reason()})"
    except ValueError as e:  # a SPECFLEET_ISA this CPU cannot run
        return f"none ({e})"


def kernel_tuning() -> dict | None:
    """The kernels' speed settings in this process (prefetch distances, the fewest rows in weight-row groups)."""
    from specfleet.runtime.backends.native import kernels as native_backend

    try:
        return native_backend.tuning()
    except ValueError:  # a SPECFLEET_ISA this CPU cannot run
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def command_line() -> str:
    """The command as typed: `specfleet ...`, `python -m package ...` or `python script ...`."""
    main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if sys.argv[0].endswith("specfleet"):
        head = [Path(sys.argv[0]).name]
    elif main_spec is not None and main_spec.name:
        head = ["python", "-m", main_spec.name.removesuffix(".__main__")]
    else:
        head = ["python", sys.argv[0]]
    return " ".join(shlex.quote(a) for a in head + sys.argv[1:])


def run_metadata(name: str, device: str = "cpu", dtype: str = "", command: str | None = None) -> dict:
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return {"benchmark": name, "timestamp_utc": stamp, "command": command or command_line(), "dtype": dtype,
            "machine": machine_info(device)}


def markdown_header(meta: dict) -> str:
    m, device = meta["machine"], meta["machine"]["device"]
    return (f"# {meta['benchmark']}\n\n- command: `{meta['command']}`\n- when (UTC): {meta['timestamp_utc']}\n"
            f"- machine: {m['cpu']} ({m.get('cpu_family_model', '?')}; {'+'.join(m.get('isa', [])) or 'ISA unknown'}; "
            f"kernels: {m.get('kernel_isa', '?')}{_tuning_text(m.get('kernel_tuning'))}), "
            f"{m['cpu_count']} cores, "
            f"torch threads {m['torch_threads']}, OMP_WAIT_POLICY {m.get('omp_wait_policy', '-')}"
            f"{', GPU ' + m['gpu'] if 'gpu' in m else ''}\n- device: {device}, dtype: {meta['dtype']}\n"
            f"- versions: python {m['python']}, torch {m['torch']}, transformers {m.get('transformers', '-')}\n\n")


def _tuning_text(t: dict | None) -> str:
    if not t:
        return ""
    pf = "/".join(str(b) for b in t["prefetch_bytes"])
    act = t.get("group_act_bytes", 0)
    far = t.get("prefetch_far") or [0, 0]
    more = (f", then {far[0]}/{far[1]} B into L2" if any(far) else "") + (
        f", one-row chunks of {t['chunk_bytes']} B" if t.get("chunk_bytes") else "") + (
        ", chunks handed out in guided runs" if t.get("schedule") == "guided" else "")
    return (f", prefetch {pf} B{' (more rows into L2)' if t.get('prefetch_l2') else ''}{more}, weight-row groups from "
            f"{t['group_min_rows']} rows{f' (from 2 past {act} B of activations)' if act else ''}")


def result_path(meta: dict) -> Path:
    """The one naming rule for results: RESULTS_DIR/<name>-<device>-<UTC stamp>, e.g. draft-cost-cpu-20261127T011339Z
    (the device without its index: cuda, not cuda:0). A run of one table adds .json/.md to it (write_results); a run
    with plots or several files is a folder of that name (write_folder). The name is the run id RESULTS.md quotes."""
    device = meta["machine"]["device"].split(":")[0]
    return RESULTS_DIR / f"{meta['benchmark']}-{device}-{meta['timestamp_utc']}"


def write_results(name: str, payload: dict, markdown_body: str, device: str = "cpu", dtype: str = "") -> Path:
    """Write <name>-<device>-<timestamp>.json and .md under RESULTS_DIR (result_path); returns the JSON path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    meta = run_metadata(name, device, dtype)
    base = result_path(meta)
    base.with_suffix(".json").write_text(json.dumps({**meta, "results": payload}, indent=2))
    base.with_suffix(".md").write_text(markdown_header(meta) + markdown_body + "\n")
    return base.with_suffix(".json")


def write_folder(out_dir: Path, meta: dict, payload: dict, markdown_body: str) -> tuple[Path, Path]:
    """Write results.json and report.md into `out_dir` (created); returns both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / "results.json", out_dir / "report.md"
    json_path.write_text(json.dumps(_finite({**meta, "results": payload}), indent=2, default=str))
    md_path.write_text(markdown_header(meta) + markdown_body + "\n")
    return json_path, md_path


def _finite(value):
    """The same structure with NaN and infinities as null, so the file is strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def md_table(rows: list[dict], columns: list[str], headers: list[str] | None = None) -> str:
    out = ["| " + " | ".join(headers or columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        out.append("| " + " | ".join(_fmt(r.get(c, "")) for c in columns) + " |")
    return "\n".join(out)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v != v:  # nan
            return "-"
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)
