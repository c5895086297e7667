"""Per-request records of a streamed OpenAI load test and their summary, as ``vllm bench serve`` computes it
(``vllm/benchmarks/serve.py``): TTFT, from sending the request to its first streamed token; TPOT,
(E2E - TTFT) / (output tokens - 1) for requests with more than one output token; ITL, every gap between two
successive streamed chunks of a request, pooled over requests; E2E, the whole request; request and output
throughput over the run's duration, output tokens from the response's ``usage``. Percentiles are numpy's
(interpolated), as there. Used by ``loadtest/locustfile.py``; no Locust import here (it patches the process).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

PERCENTILES = (50, 90, 99)


@dataclass
class Outcome:
    """One request, as vllm bench serve records one (seconds)."""

    workload: str
    start: float
    ok: bool = False
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ok and self.output_tokens > 1 and self.ttft is not None and self.e2e is not None:
            return (self.e2e - self.ttft) / (self.output_tokens - 1)
        return None


def summarize(outcomes: list[Outcome], duration_s: float) -> dict:
    """vllm bench serve's summary: throughputs and mean/percentiles of TTFT, TPOT, ITL and E2E (ms), per
    workload and over all; percentiles interpolated as numpy's (the default of vllm bench serve)."""
    import numpy as np

    def stats(values: list[float]) -> dict:
        if not values:
            return {"n": 0}
        ms = 1e3 * np.asarray(values)
        return {"n": len(values), "mean": float(ms.mean()),
                **{f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES}}

    def block(chosen: list[Outcome]) -> dict:
        ok = [o for o in chosen if o.ok]
        return {"requests": len(chosen), "completed": len(ok), "failed": len(chosen) - len(ok),
                "output_tokens": sum(o.output_tokens for o in ok),
                "mean_output_tokens": sum(o.output_tokens for o in ok) / len(ok) if ok else None,
                "mean_prompt_tokens": sum(o.prompt_tokens for o in ok) / len(ok) if ok else None,
                "request_throughput": len(ok) / duration_s, "output_throughput":
                    sum(o.output_tokens for o in ok) / duration_s,
                "ttft_ms": stats([o.ttft for o in ok if o.ttft is not None]),
                "tpot_ms": stats([t for o in ok if (t := o.tpot) is not None]),
                "itl_ms": stats([g for o in ok for g in o.itl]),
                "e2e_ms": stats([o.e2e for o in ok if o.e2e is not None])}

    workloads = sorted({o.workload for o in outcomes})
    return {"duration_s": duration_s, "all": block(outcomes),
            "by_workload": {w: block([o for o in outcomes if o.workload == w]) for w in workloads},
            "errors": sorted({o.error for o in outcomes if o.error})[:20]}


def write_report(path: str, summary: dict, outcomes: list[Outcome], settings: dict) -> None:
    """PATH.json (settings, machine, summary, every request), PATH.md (the table) and PATH.png (CDFs)."""
    from datetime import datetime, timezone

    from loadtest.machine import describe, header

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"command": settings["command"], "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": describe(), "settings": settings, "summary": summary,
              "requests": [asdict(o) | {"tpot": o.tpot} for o in outcomes]}
    out.with_name(out.name + ".json").write_text(json.dumps(result, indent=1))
    lines = header(result, f"Locust run, {settings['mode']}", f"server at {settings['host']}")
    lines += [f"Duration {summary['duration_s']:.0f} s; mix {settings['mix']}; max_tokens {settings['max_tokens']} "
              "(outputs end at EOS). Metrics as `vllm bench serve` defines them (loadtest/request_metrics.py).", "",
              "| workload | completed | failed | req/s | output tok/s | mean out tokens | "
              + " | ".join(f"{m} {q}" for m in ("TTFT", "TPOT", "ITL", "E2E") for q in ("mean", "p50", "p99"))
              + " |",
              "|---|" + "---|" * (5 + 12)]
    for name, b in [("all", summary["all"]), *summary["by_workload"].items()]:
        cells = [name, str(b["completed"]), str(b["failed"]), f"{b['request_throughput']:.2f}",
                 f"{b['output_throughput']:.1f}",
                 f"{b['mean_output_tokens']:.0f}" if b["mean_output_tokens"] is not None else "-"]
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            s = b[metric]
            cells += [f"{s[q]:.0f}" if s["n"] else "-" for q in ("mean", "p50", "p99")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Times in ms. " + (f"Errors: {summary['errors']}" if summary["errors"] else "No errors."), "",
              f"![latency CDFs]({out.name}.png)", ""]
    out.with_name(out.name + ".md").write_text("\n".join(lines))
    _plot(out.with_name(out.name + ".png"), outcomes)


def _plot(path: Path, outcomes: list[Outcome]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, (title, get) in zip(axes, [("TTFT (s)", lambda o: [o.ttft]), ("TPOT (ms)", lambda o: [1e3 * o.tpot]
                                       if o.tpot is not None else []), ("E2E (s)", lambda o: [o.e2e])]):
        for workload in sorted({o.workload for o in outcomes}):
            values = np.sort([v for o in outcomes if o.ok and o.workload == workload for v in get(o)
                              if v is not None])
            if len(values):
                ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post", label=workload)
        ax.set_title(title)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
