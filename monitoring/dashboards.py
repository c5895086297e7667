"""Grafana dashboards as code: ``python -m monitoring.dashboards`` writes monitoring/grafana/*.json.

Every query uses metric names the code exports (vLLM's ``vllm:*`` recorded by each replica's
engine, our ``entropic_*``); tests/test_prometheus_dashboards.py runs each one against a real
Prometheus scraping a running deployment and fails on an invalid query or an empty result.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

OUT = Path(__file__).resolve().parent / "grafana"
RATE = "$__rate_interval"


@dataclass
class Panel:
    title: str
    exprs: dict[str, str]  # legend -> PromQL
    unit: str = "short"
    kind: str = "timeseries"
    description: str = ""


@dataclass
class Row:
    title: str
    panels: list[Panel] = field(default_factory=list)


def quantiles(metric: str) -> dict[str, str]:
    return {f"p{int(q * 100)}": f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket[{RATE}])))"
            for q in (0.5, 0.95, 0.99)}


def mean(metric: str) -> str:
    return f"sum(rate({metric}_sum[{RATE}])) / sum(rate({metric}_count[{RATE}]))"


def heatmap(metric: str) -> dict[str, str]:
    return {"{{le}}": f"sum by (le) (rate({metric}_bucket[{RATE}]))"}


SERVING = [
    Row("Request latency", [
        Panel("Time to first token", quantiles("vllm:time_to_first_token_seconds"), "s"),
        Panel("Inter-token latency", quantiles("vllm:inter_token_latency_seconds"), "s"),
        Panel("End-to-end request latency", quantiles("vllm:e2e_request_latency_seconds"), "s"),
    ]),
    Row("Throughput and load", [
        Panel("Tokens per second", {
            "generated": f"sum(rate(vllm:generation_tokens_total[{RATE}]))",
            "prompt": f"sum(rate(vllm:prompt_tokens_total[{RATE}]))"}, "short"),
        Panel("Finished requests per second", {
            "{{finished_reason}}": f"sum by (finished_reason) (rate(vllm:request_success_total[{RATE}]))"}, "reqps"),
        Panel("Running and waiting requests", {
            "running {{replica}}": "sum by (replica) (vllm:num_requests_running)",
            "waiting {{replica}}": "sum by (replica) (vllm:num_requests_waiting)"}),
        Panel("KV-cache usage", {"{{replica}}": "max by (replica) (vllm:kv_cache_usage_perc)"}, "percentunit"),
        Panel("Preemptions per second", {"{{replica}}": f"sum by (replica) (rate(vllm:num_preemptions_total[{RATE}]))"}),
        Panel("HTTP responses per second, by code", {
            "{{code}}": f"sum by (code) (rate(entropic_http_responses_total[{RATE}]))"}, "reqps",
              description="Every response the ingress sent; 429/503 are shed requests, other 5xx server errors"),
    ]),
    Row("Entropy control (micro layer)", [
        Panel("Token entropy Ĥ distribution", heatmap("entropic_token_entropy_nats"), kind="heatmap",
              description="Entropy estimate of each generated token's distribution (nats)"),
        Panel("Mean token entropy Ĥ", {"mean": mean("entropic_token_entropy_nats")}),
        Panel("Sampling temperature T distribution", heatmap("entropic_token_temperature"), kind="heatmap"),
        Panel("Mean sampling temperature", {"mean": mean("entropic_token_temperature")}),
        Panel("Entropic time τ per request", {**quantiles("entropic_request_entropic_time_nats"),
                                              "mean": mean("entropic_request_entropic_time_nats")}),
        Panel("Estimator share of engine step time", {
            "{{replica}}": f"sum by (replica) (rate(entropic_estimator_seconds_sum[{RATE}])) / "
                           f"sum by (replica) (rate(entropic_engine_step_seconds_sum[{RATE}]))"}, "percentunit"),
    ]),
    Row("Entropic KV pruning (meso layer)", [
        Panel("KV blocks kept / held", {**quantiles("entropic_kv_blocks_kept_ratio"),
                                        "mean": mean("entropic_kv_blocks_kept_ratio")}, "percentunit",
              description="Per decode step of pruning-enabled requests; 1 = dense (e.g. short contexts)"),
        Panel("Attention FLOPs saved per second", {
            "{{replica}}": f"sum by (replica) (rate(entropic_attention_flops_saved_total[{RATE}]))"}),
        Panel("KV-cache bytes not read per second", {
            "{{replica}}": f"sum by (replica) (rate(entropic_kv_bytes_saved_total[{RATE}]))"}, "Bps"),
        Panel("Block selection share of engine step time", {
            "{{replica}}": f"sum by (replica) (rate(entropic_pruning_selection_seconds_total[{RATE}])) / "
                           f"sum by (replica) (rate(entropic_engine_step_seconds_sum[{RATE}]))"}, "percentunit"),
    ]),
    Row("Entropy-aware scheduling (macro layer)", [
        Panel("π(s) distribution", heatmap("entropic_priority"), kind="heatmap",
              description="Priority published to each replica's scheduler, per sequence and control period"),
        Panel("π source (controller vs local fallback)", {
            "{{source}}": f"sum by (source) (rate(entropic_priority_count[{RATE}]))"}),
        Panel("Priority preemptions per second", {
            "{{replica}}": f"sum by (replica) (rate(entropic_priority_preemptions_total[{RATE}]))"}),
        Panel("Decode-step grants", {
            "renewed/s {{replica}}": f"sum by (replica) (rate(entropic_grants_renewed_total[{RATE}]))",
            "withheld sequence-steps/s {{replica}}":
                f"sum by (replica) (rate(entropic_grant_withheld_steps_total[{RATE}]))"},
              description="Leases renewed by the control loop; running sequences paused for lack of a lease "
                          "(only with scheduling.grant_slots set)"),
    ]),
    Row("Entropy-aligned decoding (EPIC requests)", [
        Panel("EPIC tokens per second, by exactness", {
            "exact={{exact}}": f"sum by (exact) (rate(entropic_epic_tokens_total[{RATE}]))"},
              description="exact=false: the request's rollout budget cut the search short or was spent"),
        Panel("Rollout tokens per EPIC token", {
            "mean": f"sum(rate(entropic_epic_rollout_tokens_total[{RATE}])) / "
                    f"sum(rate(entropic_epic_tokens_total[{RATE}]))"},
              description="Engine tokens spent on lookahead rollouts for each token EPIC chose"),
        Panel("Candidates evaluated per EPIC token", {**quantiles("entropic_epic_candidates_evaluated"),
                                                       "mean": mean("entropic_epic_candidates_evaluated")}),
        Panel("Lookahead entropy of the chosen token", quantiles("entropic_epic_lookahead_entropy_nats"),
              description="nats over the horizon, where the chosen token's lookahead was estimated"),
    ]),
    Row("Controller", [
        Panel("Telemetry lag (replica to controller)", quantiles("entropic_telemetry_lag_seconds"), "s"),
        Panel("Telemetry reports per second", {"reports": f"sum(rate(entropic_telemetry_reports_total[{RATE}]))"}),
        Panel("Controller loop latency (per report)", quantiles("entropic_controller_loop_seconds"), "s"),
        Panel("Routing decisions per second, by load source", {
            "{{source}}": f"sum by (source) (rate(entropic_routing_decisions_total[{RATE}]))"},
              description="controller: ranked from the controller's view; replica_stats: Serve's polled stats "
                          "(controller down or late); none: nothing known; grant: the controller's dispatch chose"),
    ]),
    Row("Dispatch (the controller's cluster-wide queue; with dispatch on)", [
        Panel("Queue length and oldest wait", {
            "queued": "sum(entropic_dispatch_queue_length)",
            "oldest wait (s)": "max(entropic_dispatch_queue_oldest_seconds)"}),
        Panel("Wait in the queue until a grant", quantiles("entropic_dispatch_wait_seconds"), "s"),
        Panel("Admissions per second, by outcome", {
            "{{outcome}}": f"sum by (outcome) (rate(entropic_dispatch_admissions_total[{RATE}]))"}, "reqps",
              description="controller: granted a replica; fallback: the controller was unreachable or late and "
                          "Serve's router chose; queue_full, deadline: shed with 503"),
        Panel("Shed per second, by reason", {
            "{{reason}}": f"sum by (reason) (rate(entropic_dispatch_shed_total[{RATE}]))"}, "reqps"),
        Panel("Where granted requests landed", {
            "{{where}}": f"sum by (where) (rate(entropic_dispatch_landed_total[{RATE}]))"}, "reqps",
              description="granted: on the replica the grant named; elsewhere: Serve sent it to another; unseen: "
                          "no report showed it (finished between two reports)"),
        Panel("Queue decision time", quantiles("entropic_dispatch_decision_seconds"), "s"),
    ]),
]


def panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict:
    targets = [{"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend,
                "datasource": {"type": "prometheus", "uid": "${datasource}"}}
               for i, (legend, expr) in enumerate(panel.exprs.items())]
    body = {"id": panel_id, "type": panel.kind, "title": panel.title, "description": panel.description,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 8, "x": x, "y": y}, "targets": targets,
            "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []}}
    if panel.kind == "heatmap":
        body["options"] = {"calculate": False, "yAxis": {"unit": panel.unit}}
        for t in targets:
            t["format"] = "heatmap"
    return body


def dashboard(uid: str, title: str, rows: list[Row]) -> dict:
    panels, panel_id, y = [], 1, 0
    for row in rows:
        panels.append({"id": panel_id, "type": "row", "title": row.title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        panel_id, y = panel_id + 1, y + 1
        for i, panel in enumerate(row.panels):
            panels.append(panel_json(panel, panel_id, (i % 3) * 8, y + (i // 3) * 8))
            panel_id += 1
        y += 8 * ((len(row.panels) + 2) // 3)
    return {
        "uid": uid, "title": title, "schemaVersion": 39, "version": 1, "editable": True,
        "tags": ["entropic-serve", "vllm", "ray-serve"], "time": {"from": "now-30m", "to": "now"},
        "refresh": "10s",
        "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus",
                                 "label": "Prometheus"}]},
        "panels": panels,
    }


DASHBOARDS = {"entropic-serve.json": dashboard("entropic-serve", "entropic-serve: serving and entropy control", SERVING)}


def render() -> dict[str, str]:
    return {name: json.dumps(body, indent=2, ensure_ascii=False) + "\n" for name, body in DASHBOARDS.items()}


def queries(body: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of a dashboard."""
    return [(p["title"], t["expr"]) for p in body["panels"] if p["type"] != "row" for t in p["targets"]]


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, text in render().items():
        (OUT / name).write_text(text)
        print(OUT / name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
