"""Plot tokens/s against GPU budget, one line per strategy, from bench_plan.py's JSON; write a markdown
table of predicted against measured times.
Run: python3 benchmarks/plot_plan.py benchmarks/results/plan_llama-3-8b.json docs/plan_llama-3-8b.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot(doc: dict, png: str) -> None:
    """One panel per phase: tokens/s (log scale) against budget (% of weights), a line per strategy."""
    phases = sorted({p["phase"] for p in doc["points"]}, key=["decode", "prefill"].index)
    fig, axes = plt.subplots(1, len(phases), figsize=(5.5 * len(phases), 4))
    for ax, phase in zip(axes, phases, strict=True):
        for strategy, style in (("stream", "o-"), ("uva", "s--"), ("auto", "x:")):
            pts = sorted((p for p in doc["points"] if p["phase"] == phase and p["strategy"] == strategy
                          and "median_ms" in p), key=lambda p: p["fraction"])
            ax.plot([100 * p["fraction"] for p in pts], [p["tokens"] / p["median_ms"] * 1e3 for p in pts],
                    style, label=strategy)
        tokens = next(p["tokens"] for p in doc["points"] if p["phase"] == phase)
        ax.set_title(f"{phase} ({tokens} token{'s' if tokens > 1 else ''} per forward)")
        ax.set_xlabel("GPU budget for weights (% of the model's bytes)")
        ax.set_ylabel("tokens/s")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"Llama-3-8B bf16 on {doc['gpu']}, host->GPU {doc['h2d_bandwidth_GBps']:.1f} GB/s")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def table(doc: dict) -> str:
    """Markdown: budget, phase, strategy, placement, measured and predicted ms, error, exact."""
    rows = ["| budget | phase | strategy | placement | measured ms | predicted ms | error | exact |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p in doc["points"]:
        placement = (f"{p['placement']}: {p['streamed']} streamed / {p['slots']} slots, {p['uva']} zero copy"
                     if "placement" in p else p.get("error", ""))
        if p.get("part"):  # recorded since parameter-granular placement
            placement += f" ({p['part']} largest tensors of each streamed block)"
        rows.append(f"| {p['fraction']:.0%} | {p['phase']} | {p['strategy']} | {placement} | "
                    f"{p.get('median_ms', float('nan')):.2f} | {p.get('predicted_ms', float('nan')):.2f} | "
                    f"{p.get('prediction_error', float('nan')):+.1%} | {p.get('exact')} |")
    return "\n".join(rows)


if __name__ == "__main__":
    source, png = sys.argv[1], sys.argv[2]
    doc = json.loads(open(source).read())
    plot(doc, png)
    print(table(doc))
