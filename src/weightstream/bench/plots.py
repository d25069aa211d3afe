"""Plots of stored results: tokens/s against the GPU budget per phase, and one forward's copy/compute
timeline. Needs matplotlib (the `bench` and `test` extras); nothing here runs a model."""

from __future__ import annotations

from . import methods as registry


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(docs: list[dict], phase: str) -> dict[tuple[str, str], list[tuple[int | None, float]]]:
    """(method, mode) -> [(budget bytes or None, tokens/s)] of the measured rows of one phase."""
    series: dict[tuple[str, str], list] = {}
    for doc in docs:
        for r in doc["results"]:
            if r["phase"] == phase and r["median_ms"] is not None:
                series.setdefault((r["method"], r["mode"]), []).append((r["budget_bytes"], r["tokens_per_s"]))
    return series


def _size_unit(docs: list[dict]) -> tuple[int, str]:
    """The binary unit that suits the largest budget of the documents: (bytes per unit, its name)."""
    largest = max((b for d in docs for b in d.get("budgets") or [] if b), default=2**30)
    return next((2**e, n) for e, n in ((30, "GiB"), (20, "MiB"), (10, "KiB"), (0, "B")) if largest >= 2**e)


def _plot_phase(ax, docs: list[dict], phase: str) -> None:
    names = [m.name for m in registry.METHODS]
    unit, unit_name = _size_unit(docs)
    styles = {"eager": "-", "compiled": "--", "graph": ":", "graph-eager": "-."}
    for (method, mode), points in sorted(_series(docs, phase).items()):
        color = f"C{names.index(method) if method in names else len(names)}"
        label = f"{method} {mode}"
        budgeted = sorted((b / unit, t) for b, t in points if b is not None)
        if budgeted:
            ax.plot(*zip(*budgeted, strict=True), styles[mode], marker="o", color=color, label=label)
        for _, t in [p for p in points if p[0] is None][:1]:
            ax.axhline(t, linestyle=styles[mode], color=color, alpha=0.7, label=label)
    ax.set(title=phase, xlabel=f"GPU budget for weights ({unit_name})", ylabel="tokens/s", yscale="log")
    ax.grid(True, alpha=0.3)


def plot_tokens_per_s(docs: list[dict], png_path: str) -> None:
    """tokens/s of each method and mode against the GPU budget, one panel per phase (log scale).
    Methods without a budget (resident, accelerate cpu_offload, diffusers) are horizontal lines.
    Needs matplotlib (the `bench` extra)."""
    plt = _pyplot()
    phases = list(dict.fromkeys(r["phase"] for d in docs for r in d["results"]))
    fig, axes = plt.subplots(1, max(len(phases), 1), figsize=(5.5 * max(len(phases), 1), 4.5), squeeze=False)
    for ax, phase in zip(axes[0], phases, strict=False):
        _plot_phase(ax, docs, phase)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    shapes = ", ".join(sorted({d["shape"]["name"] for d in docs}))
    fig.suptitle(f"{shapes} on {docs[0]['gpu'] if docs else '?'}")
    fig.tight_layout(rect=(0, 0.05 + 0.03 * (len(labels) // 4), 1, 1))
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def plot_timeline(events: list, png_path: str, title: str = "one forward") -> None:
    """Draw a forward's GPU timeline: a "copy" row (host->GPU copies), a "decode" row where compressed
    groups were decoded, and a "compute" row, from (stream, label, start_ms, end_ms) tuples. Needs
    matplotlib (the `bench` extra)."""
    plt = _pyplot()
    rows = {"compute": (0, "C0"), "copy": (1, "C1")}
    if any(e[0] == "decode" for e in events):
        rows = {"compute": (0, "C0"), "decode": (1, "C2"), "copy": (2, "C1")}
    fig, ax = plt.subplots(figsize=(12, 2.2 + 0.4 * len(rows)))
    for stream, (y, color) in rows.items():
        spans = [(float(s), float(e) - float(s)) for st, _, s, e in events if st == stream]
        ax.broken_barh(spans, (y - 0.35, 0.7), facecolors=color, edgecolors="white", linewidth=0.3)
    ax.set(yticks=list(range(len(rows))), yticklabels=list(rows), xlabel="ms from the first GPU activity",
           title=title)
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
