"""Figures the benchmarks embed in their result files: one axes per PNG, next to ``<out>.md``."""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def save_figure(out: Path, suffix: str, title: str, xlabel: str, ylabel: str, draw: Callable[[Any], None]) -> str:
    """Draw on a fresh axes with ``draw(ax)`` and save it as ``<out>-<suffix>.png``; returns that path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    draw(ax)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path = out.with_name(f"{out.name}-{suffix}.png")
    path.parent.mkdir(parents=True, exist_ok=True)  # figures are drawn before the result file is published
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return str(path)


def cdf(ax: Any, values: Sequence[float], label: str, **style: Any) -> None:
    """The empirical CDF of ``values`` as a step line."""
    ordered = sorted(values)
    ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=label, drawstyle="steps-post",
            **style)


def interval_line(ax: Any, xs: Sequence[float], estimates: Sequence[Sequence[float]], label: str,
                  **style: Any) -> None:
    """Points joined by a line, each ``(mean, low, high)`` drawn with its interval as an error bar."""
    ax.errorbar(xs, [e[0] for e in estimates], yerr=[[e[0] - e[1] for e in estimates], [e[2] - e[0] for e in estimates]],
                marker="o", capsize=3, label=label, **style)


def replot(out: str, plot: Callable[[dict, Path], list[str]], render: Callable[[dict], str]) -> None:
    """Draw the plots of a saved result (``<out>.json``) again and rewrite ``<out>.md`` with them: measures
    nothing, so a figure can change without rerunning the benchmark."""
    path = Path(out)
    saved = path.with_name(path.name + ".json")
    result = json.loads(saved.read_text())
    result["plots"] = plot(result, path)
    saved.write_text(json.dumps(result, indent=2))
    path.with_name(path.name + ".md").write_text(render(result))
