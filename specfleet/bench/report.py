"""Every benchmark run writes its figures as JSON plus a Markdown summary under benchmarks/results/,
naming the command, machine, device, dtype and library versions, so the README can quote them."""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import sys
from pathlib import Path

import torch

RESULTS_DIR = Path(os.environ.get("SPECFLEET_RESULTS_DIR", Path(__file__).resolve().parents[2] / "benchmarks" / "results"))


def machine_info(device: str = "cpu") -> dict:
    info = {
        "hostname_class": platform.machine(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
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


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def command_line() -> str:
    return " ".join(shlex.quote(a) for a in [Path(sys.argv[0]).name if sys.argv[0].endswith("specfleet") else
                                             "python " + sys.argv[0]] + sys.argv[1:])


def write_results(name: str, payload: dict, markdown_body: str, device: str = "cpu", dtype: str = "") -> Path:
    """Write <name>-<timestamp>.json and .md; returns the JSON path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    meta = {"benchmark": name, "timestamp_utc": stamp, "command": command_line(), "dtype": dtype,
            "machine": machine_info(device)}
    base = RESULTS_DIR / f"{name}-{device.split(':')[0]}-{stamp}"
    base.with_suffix(".json").write_text(json.dumps({**meta, "results": payload}, indent=2))
    m = meta["machine"]
    header = (f"# {name}\n\n- command: `{meta['command']}`\n- when (UTC): {stamp}\n"
              f"- machine: {m['cpu']}, {m['cpu_count']} cores, torch threads {m['torch_threads']}"
              f"{', GPU ' + m['gpu'] if 'gpu' in m else ''}\n- device: {device}, dtype: {dtype}\n"
              f"- versions: python {m['python']}, torch {m['torch']}, transformers {m.get('transformers', '-')}\n\n")
    base.with_suffix(".md").write_text(header + markdown_body + "\n")
    return base.with_suffix(".json")


def md_table(rows: list[dict], columns: list[str]) -> str:
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        out.append("| " + " | ".join(_fmt(r.get(c, "")) for c in columns) + " |")
    return "\n".join(out)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)
