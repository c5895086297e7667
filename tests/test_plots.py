"""The benchmarks' figures: CDF steps, and the dispatch benchmark's per-configuration latency CDFs."""
from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.bench_dispatch import plot as dispatch_plot
from loadtest.plots import cdf


def test_a_cdf_steps_through_the_sorted_values():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    cdf(ax, [3.0, 1.0, 2.0, 2.0], "x")
    (line,) = ax.get_lines()
    assert list(line.get_xdata()) == [1.0, 2.0, 2.0, 3.0]
    assert list(line.get_ydata()) == pytest.approx([0.25, 0.5, 0.75, 1.0])
    plt.close(fig)


def test_dispatch_draws_one_cdf_per_configuration_from_every_round(tmp_path: Path):
    results = {name: [{"e2e_by_request": {"a": 1.0 + i, "b": 2.0}, "ttft_by_request": {"a": 0.1, "b": 0.2}}
                      for i in range(2)] for name in ("A", "B")}
    paths = dispatch_plot(results, tmp_path / "dispatch")
    assert [Path(p).name for p in paths] == ["dispatch-e2e-cdf.png", "dispatch-ttft-cdf.png"]
    assert all(Path(p).read_bytes()[:4] == b"\x89PNG" for p in paths)
