"""Plots of benchmark results (L6): what people look at when they compare serving engines.

    serve: throughput, TTFT and ITL percentiles against concurrency, one line per engine
    bars:  offline results (bench throughput / prefix) side by side, with each one's ratio

matplotlib is an optional extra (`pip install 'tokenbus[plot]'`; the dev install has it),
imported only when a plot is asked for, and always with its file-only backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Each serve panel: (title, y label, [(summary key, line style, label suffix)]).
SERVE_PANELS = (
    (
        "Throughput",
        "tokens/s",
        [("total_token_throughput", "-", "total"), ("output_throughput", "--", "output")],
    ),
    ("Time to first token", "ms", [("median_ttft_ms", "-", "p50"), ("p99_ttft_ms", "--", "p99")]),
    ("Inter-token latency", "ms", [("median_itl_ms", "-", "p50"), ("p99_itl_ms", "--", "p99")]),
)


@dataclass(frozen=True)
class Series:
    """One engine's serve summaries (bench serve --output-json), one per concurrency."""

    label: str
    summaries: Sequence[dict[str, Any]]

    def points(self, key: str) -> tuple[list[float], list[float]]:
        """(concurrency, value) pairs sorted by concurrency; runs without the key are skipped."""
        pairs = sorted(
            (_concurrency(s), float(s[key])) for s in self.summaries if s.get(key) is not None
        )
        return [c for c, _ in pairs], [v for _, v in pairs]


def _concurrency(summary: dict[str, Any]) -> float:
    """The concurrency cap, or the peak reached when the run had none."""
    cap = summary.get("max_concurrency")
    return float(cap if cap is not None else summary.get("peak_concurrent_requests", 0))


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise ValueError(
            "plot: matplotlib is not installed (pip install 'tokenbus[plot]')"
        ) from exc
    matplotlib.use("Agg")  # files only: no display is needed or touched
    import matplotlib.pyplot as plt

    return plt


def plot_serve(series: Sequence[Series], path: str, title: str = "tokenbus bench serve") -> None:
    """Throughput, TTFT and ITL against concurrency; one colour per engine."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(SERVE_PANELS), figsize=(5 * len(SERVE_PANELS), 4))
    levels = sorted({c for s in series for c in s.points("total_token_throughput")[0]})
    for ax, (panel_title, unit, keys) in zip(axes, SERVE_PANELS):
        for index, engine in enumerate(series):
            color = f"C{index}"
            for key, style, suffix in keys:
                xs, ys = engine.points(key)
                if xs:
                    ax.plot(
                        xs, ys, style, marker="o", color=color, label=f"{engine.label} {suffix}"
                    )
        ax.set_title(panel_title)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(unit)
        if len(levels) > 1 and levels[-1] / max(levels[0], 1) >= 8:
            ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [f"{c:g}" for c in levels])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_bars(
    labels: Sequence[str],
    values: dict[str, Sequence[float]],
    path: str,
    title: str,
    unit: str = "tokens/s",
) -> None:
    """Grouped bars: for each metric in `values`, one bar per label, annotated with its
    ratio to the first label's."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5, 2 + 1.6 * len(labels) * len(values)), 4))
    width = 0.8 / max(len(labels), 1)
    for m, numbers in enumerate(values.values()):
        for i, (label, value) in enumerate(zip(labels, numbers)):
            x = m + (i - (len(labels) - 1) / 2) * width
            bar = ax.bar(x, value, width * 0.95, color=f"C{i}", label=label if m == 0 else None)
            ratio = value / numbers[0] if numbers[0] else float("nan")
            ax.bar_label(bar, [f"{value:,.0f}\n{ratio:.2f}×"], fontsize=8)
    ax.set_xticks(range(len(values)), list(values))
    ax.set_ylabel(unit)
    ax.set_title(title)
    ax.margins(y=0.2)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
