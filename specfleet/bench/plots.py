"""PNG plots of one benchmark part (matplotlib, Agg backend: no display needed).

- <part>-throughput.png: aggregate tokens/s per system against batch size, with the roofline bound
  for plain decoding (B x bandwidth / weight bytes) as a dashed line;
- <part>-latency.png: normalized latency (ms per output token) per request, one box per system, at
  the smallest batch size;
- <part>-acceptance.png: acceptance by draft position for every system that drafted.
"""
from __future__ import annotations

from pathlib import Path


def plot_part(part: dict, out_dir: Path) -> list[Path]:
    """Write the part's plots into `out_dir`; returns the files written (none without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    files = []
    for name, draw in (("throughput", _throughput), ("latency", _latency), ("acceptance", _acceptance)):
        fig, ax = plt.subplots(figsize=(7, 4.2))
        if draw(part, ax):
            ax.set_title(f"{part['name']}: {ax.get_title()}", fontsize=10)
            ax.grid(alpha=0.3)
            fig.tight_layout()
            path = out_dir / f"{part['name']}-{name}.png"
            fig.savefig(path, dpi=110)
            files.append(path)
        plt.close(fig)
    return files


def _systems(part: dict) -> list[str]:
    return [s["label"] for s in part["systems"]]


def _throughput(part: dict, ax) -> bool:
    rows = part["summaries"]
    batches = sorted({r["batch_size"] for r in rows})
    if len(batches) == 1:  # one batch size: bars read better than single points
        labels = [r["system"] for r in rows]
        ax.bar(range(len(rows)), [r["throughput_tok_s"] for r in rows], color="tab:blue")
        ax.set_xticks(range(len(rows)), labels, rotation=20, ha="right", fontsize=8)
        if part["roofline_tok_s"]:
            ax.axhline(part["roofline_tok_s"] * rows[0]["mean_concurrency"], ls="--", color="gray",
                       label="roofline (plain decoding)")
            ax.legend(fontsize=8)
    else:
        for label in _systems(part):
            pts = sorted((r["batch_size"], r["throughput_tok_s"]) for r in rows if r["system"] == label)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label)
        if part["roofline_tok_s"]:
            ax.plot(batches, [part["roofline_tok_s"] * b for b in batches], ls="--", color="gray",
                    label="roofline (plain decoding)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("batch size (concurrent requests)")
        ax.legend(fontsize=8)
    ax.set_ylabel("output tokens / s")
    ax.set_title("aggregate throughput")
    return bool(rows)


def _latency(part: dict, ax) -> bool:
    reqs = part["requests"]
    if not reqs:
        return False
    b = min(r["batch_size"] for r in reqs)
    data, labels = [], []
    for label in _systems(part):
        vals = [r["normalized_latency_s"] * 1e3 for r in reqs if r["system"] == label and r["batch_size"] == b
                and r["output_tokens"]]
        if vals:
            data.append(vals)
            labels.append(label)
    if not data:
        return False
    ax.boxplot(data)
    ax.set_xticks(range(1, len(labels) + 1), labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("ms per output token")
    ax.set_title(f"normalized latency, batch {b}")
    return True


def _acceptance(part: dict, ax) -> bool:
    drawn = False
    for r in part["summaries"]:
        rates = r.get("acceptance_by_position") or []
        if r.get("drafted") and rates:
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=f"{r['system']} (batch {r['batch_size']})")
            drawn = True
    if drawn:
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("draft position k")
        ax.set_ylabel("fraction of steps accepting >= k tokens")
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize=8)
        ax.set_title("acceptance by position")
    return drawn
