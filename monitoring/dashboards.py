"""Grafana dashboards as code: ``python -m monitoring.dashboards`` writes monitoring/grafana/*.json.

The panels are listed here as data (title, PromQL per legend, unit); grafana-foundation-sdk, Grafana's own
builder library, turns them into the dashboard's JSON model. A ``model_name`` variable (all models by
default) filters every series our replicas and vLLM's engines label with the model; the controller's and
the ingress's series carry none. Every query uses metric names the code exports (vLLM's ``vllm:*``
recorded by each replica's engine, our ``entropic_*``, and on the Ray metrics path Serve's own
``ray_serve_*``); tests/test_prometheus_dashboards.py runs each one against a real Prometheus scraping a
running deployment and fails on an invalid query or an empty result.
"""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "grafana"
RATE = "$__rate_interval"
NATS = "suffix: nats"  # Grafana's custom-unit syntax: no built-in unit for nats


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


MODEL = 'model_name=~"$model_name"'


def by_model(metric: str) -> str:
    """``metric`` restricted to the models the ``model_name`` variable selects (series our replicas and vLLM's
    engines label with ``model_name``; the controller's and the ingress's carry no model and are not filtered)."""
    return f"{metric}{{{MODEL}}}"


def quantiles(metric: str, qs: tuple[float, ...] = (0.5, 0.95, 0.99), model: bool = True,
              prefix: str = "") -> dict[str, str]:
    bucket = by_model(f"{metric}_bucket") if model else f"{metric}_bucket"
    return {f"{prefix}p{int(q * 100)}": f"histogram_quantile({q}, sum by (le) (rate({bucket}[{RATE}])))" for q in qs}


def mean(metric: str) -> str:
    return f"sum(rate({by_model(metric + '_sum')}[{RATE}])) / sum(rate({by_model(metric + '_count')}[{RATE}]))"


def heatmap(metric: str) -> dict[str, str]:
    return {"{{le}}": f"sum by (le) (rate({by_model(metric + '_bucket')}[{RATE}]))"}


def rate_by(metric: str, label: str, model: bool = True) -> str:
    return f"sum by ({label}) (rate({by_model(metric) if model else metric}[{RATE}]))"


SERVING = [
    Row("Request latency", [
        Panel("Time to first token", quantiles("vllm:time_to_first_token_seconds"), "s"),
        Panel("Time per output token (TPOT)", quantiles("vllm:request_time_per_output_token_seconds"), "s",
              description="Per request: decode time over its output tokens after the first"),
        Panel("Inter-token latency", quantiles("vllm:inter_token_latency_seconds"), "s"),
        Panel("End-to-end request latency", quantiles("vllm:e2e_request_latency_seconds"), "s"),
        Panel("Queue time", quantiles("vllm:request_queue_time_seconds"), "s",
              description="Time a request waited in its engine's queue before its first step: what π "
                          "scheduling reorders"),
        Panel("Prefill and decode time per request", {
            **quantiles("vllm:request_prefill_time_seconds", (0.5, 0.95), prefix="prefill "),
            **quantiles("vllm:request_decode_time_seconds", (0.5, 0.95), prefix="decode ")}, "s"),
    ]),
    Row("Throughput and load", [
        Panel("Tokens per second", {
            "generated": f"sum(rate({by_model('vllm:generation_tokens_total')}[{RATE}]))",
            "prompt": f"sum(rate({by_model('vllm:prompt_tokens_total')}[{RATE}]))"}, "tokens/s"),
        Panel("Finished requests per second", {
            "{{finished_reason}}": rate_by("vllm:request_success_total", "finished_reason")}, "reqps"),
        Panel("Running and waiting requests", {
            "running {{replica}}": f"sum by (replica) ({by_model('vllm:num_requests_running')})",
            "waiting {{replica}}": f"sum by (replica) ({by_model('vllm:num_requests_waiting')})"}),
        Panel("KV-cache usage", {"{{replica}}": f"max by (replica) ({by_model('vllm:kv_cache_usage_perc')})"},
              "percentunit"),
        Panel("Prefix-cache hit rate", {
            "{{replica}}": f"{rate_by('vllm:prefix_cache_hits_total', 'replica')} / "
                           f"{rate_by('vllm:prefix_cache_queries_total', 'replica')}"}, "percentunit",
              description="Prompt tokens found in the prefix cache, of those looked up"),
        Panel("Preemptions per second", {"{{replica}}": rate_by("vllm:num_preemptions_total", "replica")}),
        Panel("Steps on borrowed cores per second", {
            "{{outcome}}": rate_by("entropic_borrowed_core_steps_total", "outcome")},
              description="CPU engines: steps large enough (a prefill, a long-context decode) to run threads on "
                          "the serving path's cores too; "
                          "refused: lent to another engine of the node at the time (workers/step_threads.py)"),
        Panel("Prompt length", quantiles("vllm:request_prompt_tokens"), "short",
              description="Prompt tokens per finished request"),
        Panel("Generation length", quantiles("vllm:request_generation_tokens"), "short",
              description="Output tokens per finished request"),
        Panel("HTTP responses per second, by code", {
            "{{code}}": rate_by("entropic_http_responses_total", "code", model=False)}, "reqps",
              description="Every response the ingress sent; 429/503 are shed requests, other 5xx server errors"),
    ]),
    Row("Replicas", [
        Panel("Worker replicas reporting", {
            "replicas": f"count(count by (replica) ({by_model('vllm:num_requests_running')}))"},
              description="Replicas whose engines report, by the replica label each one's series carry"),
        Panel("Healthy replicas, by deployment (Ray metrics path)", {
            "{{deployment}}": 'sum by (deployment) (ray_serve_deployment_replica_healthy{application="entropic"})'},
              description="Serve's own health checks. On the Ray metrics path only (monitoring/prometheus-ray.yml, "
                          "k8s/monitoring): the merged /metrics page has no Ray series"),
        Panel("Serve queue: requests waiting for a replica (Ray metrics path)", {
            "{{deployment}}": 'sum by (deployment) (ray_serve_deployment_queued_queries{application="entropic"})'},
              description="Requests Serve's handles hold until a replica takes them (max_queued_requests bounds "
                          "it). On the Ray metrics path only"),
    ]),
    Row("Entropy control (micro layer)", [
        Panel("Token entropy Ĥ distribution", heatmap("entropic_token_entropy_nats"), NATS, kind="heatmap",
              description="Entropy estimate of each generated token's distribution (nats)"),
        Panel("Mean token entropy Ĥ", {"mean": mean("entropic_token_entropy_nats")}, NATS),
        Panel("Sampling temperature T distribution", heatmap("entropic_token_temperature"), kind="heatmap"),
        Panel("Mean sampling temperature", {"mean": mean("entropic_token_temperature")}),
        Panel("Entropic time τ per request", {**quantiles("entropic_request_entropic_time_nats"),
                                              "mean": mean("entropic_request_entropic_time_nats")}, NATS),
        Panel("Estimator share of engine step time", {
            "{{replica}}": f"{rate_by('entropic_estimator_seconds_sum', 'replica')} / "
                           f"{rate_by('entropic_engine_step_seconds_sum', 'replica')}"}, "percentunit"),
    ]),
    Row("Entropic KV pruning (meso layer)", [
        Panel("KV blocks kept / held", {**quantiles("entropic_kv_blocks_kept_ratio"),
                                        "mean": mean("entropic_kv_blocks_kept_ratio")}, "percentunit",
              description="Per decode step of pruning-enabled requests; 1 = dense (e.g. short contexts)"),
        Panel("Attention FLOPs saved per second", {
            "{{replica}}": rate_by("entropic_attention_flops_saved_total", "replica")}),
        Panel("KV-cache bytes not read per second", {
            "{{replica}}": rate_by("entropic_kv_bytes_saved_total", "replica")}, "Bps"),
        Panel("Block selection share of engine step time", {
            "{{replica}}": f"{rate_by('entropic_pruning_selection_seconds_total', 'replica')} / "
                           f"{rate_by('entropic_engine_step_seconds_sum', 'replica')}"}, "percentunit"),
    ]),
    Row("Entropy-aware scheduling (macro layer)", [
        Panel("π(s) distribution", heatmap("entropic_priority"), kind="heatmap",
              description="Priority published to each replica's scheduler, per sequence and control period"),
        Panel("π source (controller vs local fallback)", {
            "{{source}}": rate_by("entropic_priority_count", "source")}),
        Panel("Priority preemptions per second", {
            "{{replica}}": rate_by("entropic_priority_preemptions_total", "replica")}),
        Panel("Decode-step grants", {
            "renewed/s {{replica}}": rate_by("entropic_grants_renewed_total", "replica"),
            "withheld sequence-steps/s {{replica}}": rate_by("entropic_grant_withheld_steps_total", "replica")},
              description="Leases renewed by the control loop; running sequences paused for lack of a lease "
                          "(only with scheduling.grant_slots set)"),
    ]),
    Row("Entropy-aligned decoding (EPIC requests)", [
        Panel("EPIC tokens per second, by exactness", {
            "exact={{exact}}": rate_by("entropic_epic_tokens_total", "exact")},
              description="exact=false: the request's rollout budget cut the search short or was spent"),
        Panel("Rollout tokens per EPIC token", {
            "mean": f"sum(rate({by_model('entropic_epic_rollout_tokens_total')}[{RATE}])) / "
                    f"sum(rate({by_model('entropic_epic_tokens_total')}[{RATE}]))"},
              description="Engine tokens spent on lookahead rollouts for each token EPIC chose"),
        Panel("Candidates evaluated per EPIC token", {**quantiles("entropic_epic_candidates_evaluated"),
                                                       "mean": mean("entropic_epic_candidates_evaluated")}),
        Panel("Lookahead entropy of the chosen token", quantiles("entropic_epic_lookahead_entropy_nats"), NATS,
              description="nats over the horizon, where the chosen token's lookahead was estimated"),
    ]),
    Row("Controller", [
        Panel("Telemetry lag (replica to controller)", quantiles("entropic_telemetry_lag_seconds", model=False), "s"),
        Panel("Telemetry reports per second", {"reports": f"sum(rate(entropic_telemetry_reports_total[{RATE}]))"},
              "reqps"),
        Panel("Controller loop latency (per report)", quantiles("entropic_controller_loop_seconds", model=False),
              "s"),
        Panel("Routing decisions per second, by load source", {
            "{{source}}": rate_by("entropic_routing_decisions_total", "source", model=False)},
              description="controller: ranked from the controller's view; replica_stats: Serve's polled stats "
                          "(controller down or late); none: nothing known; grant: the controller's dispatch chose"),
    ]),
    Row("Dispatch (the controller's cluster-wide queue; with dispatch on)", [
        Panel("Queue length and oldest wait", {
            "queued": "sum(entropic_dispatch_queue_length)",
            "oldest wait (s)": "max(entropic_dispatch_queue_oldest_seconds)"}),
        Panel("Wait in the queue until a grant", quantiles("entropic_dispatch_wait_seconds", model=False), "s"),
        Panel("Admissions per second, by outcome", {
            "{{outcome}}": rate_by("entropic_dispatch_admissions_total", "outcome", model=False)}, "reqps",
              description="controller: granted a replica; fallback: the controller was unreachable or late and "
                          "Serve's router chose; queue_full, deadline: shed with 503"),
        Panel("Shed per second, by reason", {
            "{{reason}}": rate_by("entropic_dispatch_shed_total", "reason", model=False)}, "reqps"),
        Panel("Where granted requests landed", {
            "{{where}}": rate_by("entropic_dispatch_landed_total", "where", model=False)}, "reqps",
              description="granted: on the replica the grant named; elsewhere: Serve sent it to another; unseen: "
                          "no report showed it (finished between two reports)"),
        Panel("Queue decision time", quantiles("entropic_dispatch_decision_seconds", model=False), "s"),
    ]),
]


def _datasource() -> Any:
    from grafana_foundation_sdk.models.dashboard import DataSourceRef

    return DataSourceRef(type_val="prometheus", uid="${datasource}")


def _panel(panel: Panel, panel_id: int) -> Any:
    from grafana_foundation_sdk.builders import heatmap as heatmap_panel
    from grafana_foundation_sdk.builders import timeseries
    from grafana_foundation_sdk.builders.common import VizLegendOptions, VizTooltipOptions
    from grafana_foundation_sdk.builders.prometheus import Dataquery
    from grafana_foundation_sdk.models.common import LegendDisplayMode, LegendPlacement, SortOrder, TooltipDisplayMode
    from grafana_foundation_sdk.models.prometheus import PromQueryFormat

    if panel.kind == "heatmap":
        builder: Any = (heatmap_panel.Panel().calculate(False)
                        .y_axis(heatmap_panel.YAxisConfig().unit(panel.unit)))
    else:
        builder = (timeseries.Panel().unit(panel.unit)
                   .legend(VizLegendOptions().display_mode(LegendDisplayMode.LIST).placement(LegendPlacement.BOTTOM)
                           .show_legend(True))
                   .tooltip(VizTooltipOptions().mode(TooltipDisplayMode.MULTI).sort(SortOrder.DESCENDING)))
    builder = (builder.id(panel_id).title(panel.title).description(panel.description).datasource(_datasource())
               .span(8).height(8))
    for i, (legend, expr) in enumerate(panel.exprs.items()):
        query = Dataquery().ref_id(chr(ord("A") + i)).expr(expr).legend_format(legend).datasource(_datasource())
        if panel.kind == "heatmap":
            query = query.format(PromQueryFormat.HEATMAP)
        builder = builder.with_target(query)
    return builder


def dashboard(uid: str, title: str, rows: list[Row]) -> dict:
    """The dashboard's JSON model, built with grafana-foundation-sdk."""
    from grafana_foundation_sdk.builders.dashboard import Dashboard, DatasourceVariable, QueryVariable
    from grafana_foundation_sdk.builders.dashboard import Row as SdkRow
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import VariableRefresh

    builder = (Dashboard(title).uid(uid).tags(["entropic-serve", "vllm", "ray-serve"]).editable()
               .time("now-30m", "now").refresh("10s")
               .with_variable(DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
               .with_variable(QueryVariable("model_name").label("Model").datasource(_datasource())
                              .query("label_values(vllm:num_requests_running, model_name)")
                              .refresh(VariableRefresh.ON_DASHBOARD_LOAD)
                              .multi(True).include_all(True).all_value(".*")))
    ids = itertools.count(1)
    for row in rows:
        builder = builder.with_row(SdkRow(row.title).id(next(ids)))
        for panel in row.panels:
            builder = builder.with_panel(_panel(panel, next(ids)))
    return json.loads(JSONEncoder(sort_keys=True).encode(builder.build()))


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
