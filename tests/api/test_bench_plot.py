"""Benchmark plots: the data each line is drawn from, and a PNG written without a display."""

import pytest

from tokenbus.bench.plot import Series, plot_bars, plot_serve

pytest.importorskip("matplotlib")


def summary(concurrency, total, ttft, itl, peak=None):
    return {
        "max_concurrency": concurrency,
        "peak_concurrent_requests": peak or concurrency,
        "total_token_throughput": total,
        "output_throughput": total / 4,
        "median_ttft_ms": ttft,
        "p99_ttft_ms": ttft * 2,
        "median_itl_ms": itl,
        "p99_itl_ms": itl * 3,
    }


def test_series_points_sorted_by_concurrency_and_uncapped_runs_use_their_peak():
    series = Series(
        "tokenbus",
        [
            summary(16, 900.0, 40, 20),
            summary(1, 150.0, 10, 8),
            summary(None, 1000.0, 80, 25, peak=64),
        ],
    )
    assert series.points("total_token_throughput") == ([1.0, 16.0, 64.0], [150.0, 900.0, 1000.0])
    assert series.points("p99_itl_ms") == ([1.0, 16.0, 64.0], [24.0, 60.0, 75.0])
    assert series.points("missing") == ([], [])


def is_png(path):
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_serve_and_bar_plots_are_written(tmp_path):
    ours = Series("tokenbus", [summary(c, 100.0 * c, 10 + c, 8 + c / 4) for c in (1, 4, 16)])
    peer = Series("llama.cpp", [summary(c, 60.0 * c, 12 + 2 * c, 9 + c) for c in (1, 4, 16)])
    plot_serve([ours, peer], str(tmp_path / "serve.png"))
    plot_bars(
        ["tokenbus", "hf"],
        {"total tok/s": [489.3, 116.0], "output tok/s": [141.2, 33.5]},
        str(tmp_path / "bars.png"),
        "offline throughput",
    )
    assert is_png(tmp_path / "serve.png") and is_png(tmp_path / "bars.png")
