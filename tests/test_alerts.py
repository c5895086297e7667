"""Alert rules (monitoring/alerts.py): the committed files are what the code renders, Prometheus' own
checker accepts them, and ``promtool test rules`` shows each alert firing on the series it is about and
staying quiet on healthy ones (Debian's prometheus package ships promtool)."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import yaml

from monitoring import alerts

ANNOTATIONS = {a.name: {"summary": a.summary, "description": a.description} for a in alerts.ALERTS}
SEVERITY = {a.name: a.severity for a in alerts.ALERTS}


def _promtool() -> str:
    binary = shutil.which("promtool")
    if not binary:
        message = "no promtool on PATH (`make test` installs Debian's prometheus package when run as root)"
        if os.environ.get("REQUIRE_PROMETHEUS"):  # CI (.ci/run): this must run there
            pytest.fail(message)
        pytest.skip(message)
    return binary


def _fires(name: str, at: str, **labels: str) -> dict:
    return {"eval_time": at, "alertname": name, "exp_alerts": [
        {"exp_labels": {"severity": SEVERITY[name], **labels}, "exp_annotations": ANNOTATIONS[name]}]}


def _quiet(name: str, at: str) -> dict:
    return {"eval_time": at, "alertname": name, "exp_alerts": []}


def _histogram(name: str, counts_per_minute: dict[str, int], **labels: str) -> list[dict]:
    """Cumulative bucket series of a histogram that observes ``counts_per_minute`` per bucket bound."""
    series, total = [], 0
    for le, count in counts_per_minute.items():
        total += count
        tags = ",".join(f'{k}="{v}"' for k, v in {**labels, "le": le}.items())
        series.append({"series": f"{name}_bucket{{{tags}}}", "values": f"0+{total}x40"})
    return series


def _responses(**per_minute: int) -> list[dict]:
    return [{"series": f'entropic_http_responses_total{{code="{code[1:]}",route="/v1/completions"}}',
             "values": f"0+{n}x40"} for code, n in per_minute.items()]


SCENARIOS = [
    # 10 of 110 responses per minute are 500s: server errors; 503s are shedding, not errors
    (_responses(c200=100, c500=10), [_fires("EntropicServeServerErrors", "20m"), _quiet("EntropicServeShedding", "20m")]),
    (_responses(c200=100, c503=10), [_quiet("EntropicServeServerErrors", "20m"), _fires("EntropicServeShedding", "20m")]),
    (_responses(c200=100, c429=1), [_quiet("EntropicServeShedding", "20m"), _quiet("EntropicServeServerErrors", "20m")]),
    # most first tokens after 10 s, for one model; the other model is fast
    (_histogram("vllm:time_to_first_token_seconds", {"1": 1, "10": 4, "30": 20, "+Inf": 20}, model_name="slow")
     + _histogram("vllm:time_to_first_token_seconds", {"1": 40, "10": 5, "30": 0, "+Inf": 0}, model_name="fast"),
     [_fires("EntropicServeTTFTOverSLO", "20m", model_name="slow")]),
    # engines report: some replica is serving; then none does
    ([{"series": 'vllm:num_requests_running{replica="r1"}', "values": "1x40"}],
     [_quiet("EntropicServeNoWorkerReplica", "10m")]),
    ([{"series": 'entropic_telemetry_reports_total{replica="controller"}', "values": "0+1x40"}],
     [_fires("EntropicServeNoWorkerReplica", "10m")]),
    ([{"series": 'up{job="entropic-serve",instance="ingress:8000"}', "values": "1 1 0x10"}],
     [_fires("EntropicServeMetricsDown", "10m", job="entropic-serve", instance="ingress:8000"),
      _quiet("EntropicServeMetricsDown", "2m")]),
    ([{"series": 'entropic_routing_decisions_total{source="replica_stats"}', "values": "0+9x40"},
      {"series": 'entropic_routing_decisions_total{source="controller"}', "values": "0+1x40"}],
     [_fires("EntropicServeControllerFallback", "20m")]),
    ([{"series": 'entropic_routing_decisions_total{source="replica_stats"}', "values": "0+1x40"},
      {"series": 'entropic_routing_decisions_total{source="controller"}', "values": "0+9x40"}],
     [_quiet("EntropicServeControllerFallback", "20m")]),
    ([{"series": 'vllm:kv_cache_usage_perc{replica="r1"}', "values": "0.97x40"},
      {"series": 'vllm:kv_cache_usage_perc{replica="r2"}', "values": "0.5x40"}],
     [_fires("EntropicServeKVCacheNearFull", "10m", replica="r1")]),
    (_histogram("entropic_telemetry_lag_seconds", {"0.1": 5, "1": 5, "5": 30, "+Inf": 30}),
     [_fires("EntropicServeTelemetryLag", "20m")]),
    (_histogram("entropic_telemetry_lag_seconds", {"0.1": 60, "1": 0, "5": 0, "+Inf": 0}),
     [_quiet("EntropicServeTelemetryLag", "20m")]),
]


def test_the_committed_rule_files_are_what_the_code_renders():
    for path, text in alerts.render().items():
        assert path.read_text() == text, f"{path} is stale: run `make alerts`"


def test_prometheus_accepts_the_rules_and_the_prometheus_rule_holds_the_same(tmp_path):
    promtool = _promtool()
    subprocess.run([promtool, "check", "rules", str(alerts.RULES_FILE)], check=True, capture_output=True)
    spec = yaml.safe_load(alerts.PROMETHEUS_RULE.read_text())["spec"]
    assert spec == yaml.safe_load(alerts.RULES_FILE.read_text())


def test_every_alert_fires_on_its_series_and_stays_quiet_on_healthy_ones(tmp_path):
    promtool = _promtool()
    tested = {t["alertname"] for _, checks in SCENARIOS for t in checks if t["exp_alerts"]}
    assert tested == set(ANNOTATIONS), "an alert without a scenario where it fires"
    shutil.copy(alerts.RULES_FILE, tmp_path / "alerts.yml")
    suite = {"rule_files": ["alerts.yml"], "evaluation_interval": "1m",
             "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": checks}
                       for series, checks in SCENARIOS]}
    (tmp_path / "alerts_test.yml").write_text(yaml.safe_dump(suite, sort_keys=False))
    result = subprocess.run([promtool, "test", "rules", "alerts_test.yml"], cwd=tmp_path, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr
