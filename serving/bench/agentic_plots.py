"""Plots of an agentic sweep (`agentic.run_sweep`'s result): throughput vs P90 interactivity (InferenceX's
Pareto plot), TTFT vs throughput, and theoretical vs achieved prefix-hit rate per concurrency; one line
per variant. matplotlib is imported here only (the `bench` extra)."""

from __future__ import annotations

from pathlib import Path


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("plotting the agentic sweep needs matplotlib: pip install -e '.[bench]' "
                          "(the `bench` extra)") from e
    return Figure, FigureCanvasAgg


def _series(variant: dict, key: str) -> list:
    return [p["summary"].get(key) for p in variant["points"]]


def plot_sweep(result: dict, path: str | Path):
    """Write the three panels to `path` (PNG) and return the matplotlib Figure."""
    Figure, FigureCanvasAgg = _matplotlib()
    fig = Figure(figsize=(15, 4.4), dpi=90)
    FigureCanvasAgg(fig)
    ax_pareto, ax_ttft, ax_hit = fig.subplots(1, 3)
    colors = [f"C{i}" for i in range(10)]
    for i, v in enumerate(result["variants"]):
        color, name = colors[i % len(colors)], v["name"]
        conc = [p["concurrency"] for p in v["points"]]
        tput = _series(v, "total_token_throughput")
        inter = _series(v, "p90_interactivity_tok_s")
        ttft = _series(v, "median_ttft_ms")
        ok = [(x, y, c) for x, y, c in zip(inter, tput, conc) if x is not None]
        if ok:
            ax_pareto.plot([x for x, _, _ in ok], [y for _, y, _ in ok], "o-", color=color, label=name)
            for x, y, c in ok:
                ax_pareto.annotate(f"c{c}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax_ttft.plot(tput, ttft, "o-", color=color, label=name)
        achieved = [h if h is not None else float("nan") for h in _series(v, "prefix_hit_rate")]
        theory = [h if h is not None else float("nan") for h in _series(v, "theoretical_prefix_hit_rate")]
        ax_hit.plot(conc, achieved, "o-", color=color, label=f"{name} achieved")
        ax_hit.plot(conc, theory, "x--", color=color, alpha=0.6, label=f"{name} theoretical")
    ax_pareto.set(xlabel="P90 interactivity (tok/s/user) = 1 / P90 per-request ITL",
                  ylabel="throughput (tok/s, input incl. cached + output)", title="throughput vs interactivity")
    ax_ttft.set(xlabel="throughput (tok/s, input incl. cached + output)", ylabel="median TTFT (ms)",
                title="TTFT vs throughput")
    ax_hit.set(xlabel="concurrency (lanes)", ylabel="prefix-hit rate (cached / prompt tokens)",
               title="prefix-hit rate", ylim=(0, 1.05))
    ax_hit.set_xscale("log", base=2)
    ticks = sorted({p["concurrency"] for v in result["variants"] for p in v["points"]})
    ax_hit.set_xticks(ticks, [str(t) for t in ticks])
    ax_hit.minorticks_off()
    for ax in (ax_pareto, ax_ttft, ax_hit):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    title = result.get("title")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return fig
