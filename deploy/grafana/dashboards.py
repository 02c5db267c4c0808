"""The glmserve Grafana dashboards, as data: `python deploy/grafana/dashboards.py` writes one JSON file
per dashboard into deploy/grafana/dashboards/ (committed; a test checks they are up to date, and the CI
run evaluates every panel's query against a Prometheus scraping a live `glmserve serve`).

Every query filters on the `model_name` variable and uses `$__rate_interval`; the metric names are
documented in docs/metrics.md.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

OUT = Path(__file__).resolve().parent / "dashboards"
M = 'model_name=~"$model_name"'
RI = "$__rate_interval"


@dataclass(frozen=True)
class Panel:
    title: str
    targets: tuple[tuple[str, str], ...]  # (PromQL, legend)
    unit: str = "short"
    kind: str = "timeseries"  # timeseries | stat
    description: str = ""


def quantiles(metric: str, by: str = "") -> tuple[tuple[str, str], ...]:
    """p50 and p99 of a histogram, optionally per label."""
    group = f"le, {by}" if by else "le"
    prefix = f"{{{{{by}}}}} " if by else ""
    return tuple(
        (f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{{{M}}}[{RI}])))", f"{prefix}p{int(q * 100)}")
        for q in (0.5, 0.99)
    )


def rate(metric: str, by: str = "", legend: str = "", selector: str = "") -> tuple[str, str]:
    sel = f"{M}, {selector}" if selector else M
    grouped = f"sum by ({by}) " if by else "sum "
    return f"{grouped}(rate({metric}{{{sel}}}[{RI}]))", legend or (f"{{{{{by}}}}}" if by else metric)


SLO = [
    Panel("Time to first token", quantiles("glmserve_router_time_to_first_token_seconds"), "s"),
    Panel("Inter-token latency", quantiles("glmserve_router_inter_token_latency_seconds"), "s"),
    Panel("End-to-end latency", quantiles("glmserve_router_e2e_request_latency_seconds"), "s"),
    Panel("Requests per second, by status", (rate("glmserve_router_requests_total", "status"),), "reqps"),
    Panel("Error ratio (5xx of answered requests)", ((
        f'(sum(rate(glmserve_router_requests_total{{{M}, status=~"5.."}}[{RI}])) or vector(0))'
        f' / sum(rate(glmserve_router_requests_total{{{M}, status!="499"}}[{RI}]))', "5xx ratio"),),
        "percentunit", "stat"),
    Panel("Goodput (requests within the TTFT SLO)", ((
        f"sum by (le) (rate(glmserve_router_time_to_first_token_seconds_bucket{{{M}}}[{RI}]))"
        ' and on (le) glmserve:slo_objective{slo="ttft"}', "within TTFT SLO"),
        rate("glmserve_router_request_success_total", legend="finished")), "reqps",
        description="Requests per second whose first token came within the TTFT SLO threshold "
                    "(slo-targets.yml), next to all finished requests."),
    Panel("SLO burn rate (1h)", ((f"glmserve:slo_burn_rate:1h{{{M}}}", "{{slo}}"),), "short",
          description="Error-budget burn over the last hour; 14.4 with the 5m rate pages."),
    Panel("Finish reasons", (rate("glmserve_router_request_success_total", "finished_reason"),), "reqps"),
    Panel("Rejections, by reason", (rate("glmserve_router_rejections_total", "reason"),), "reqps"),
    Panel("Tokens per second", (rate("glmserve_router_prompt_tokens_total", legend="prompt"),
                                rate("glmserve_router_generation_tokens_total", legend="generated")), "short"),
    Panel("Requests in flight", ((f"sum(glmserve_router_requests_running{{{M}}})", "running"),), "short", "stat"),
]

TRANSFER = [
    Panel("KV bytes written to decode", (rate("glmserve_kv_transfer_bytes_total", "instance"),), "Bps"),
    Panel("KV transfer latency", quantiles("glmserve_kv_transfer_seconds"), "s"),
    Panel("Transfer failures, by reason", (rate("glmserve_kv_transfer_failures_total", "reason"),), "ops"),
    Panel("Stale stamps ignored", ((f"sum(increase(glmserve_kv_transfer_stale_total{{{M}}}[{RI}]))", "stale"),),
          "short", description="Completions for an old generation or unknown request; any is a bug or a late writer."),
    Panel("Deferred block releases", (rate("glmserve_kv_transfer_deferred_releases_total", "instance"),), "ops",
          description="Aborted requests whose blocks waited for an in-flight transfer to drain (invariant 2)."),
    Panel("Prefill queue and compute time", quantiles("glmserve_worker_request_queue_time_seconds", "role")
          + quantiles("glmserve_worker_request_prefill_time_seconds"), "s"),
    Panel("Decode time per request", quantiles("glmserve_worker_request_decode_time_seconds"), "s"),
    Panel("LayerSplit: KV transfer hidden behind compute", ((
        f"1 - sum(rate(glmserve_layersplit_kv_transfer_exposed_seconds_sum{{{M}}}[{RI}]))"
        f" / sum(rate(glmserve_layersplit_kv_transfer_seconds_sum{{{M}}}[{RI}]))", "hidden"),),
        "percentunit", "stat",
        description="Share of the stages' KV write time that overlapped later chunks' compute (staged "
                    "prefill replicas only; what is not hidden delays the first token)."),
    Panel("LayerSplit: KV transfer per request, in flight and exposed",
          quantiles("glmserve_layersplit_kv_transfer_seconds")
          + tuple((q, "exposed " + legend) for q, legend in quantiles("glmserve_layersplit_kv_transfer_exposed_seconds")),
          "s", description="Exposed: the part left after the last chunk was computed (on the critical path)."),
]

CACHE = [
    Panel("Prefix-cache hit ratio", ((f"max(glmserve_prefix_cache_hit_ratio{{{M}}})", "hit ratio"),),
          "percentunit", "stat"),
    Panel("Hit tokens by tier (router)", (rate("glmserve_prefix_cache_hit_tokens_total", "tier"),
                                          rate("glmserve_prefix_cache_prompt_tokens_total", legend="prompt tokens")),
          "short"),
    Panel("Prefix lookups", (rate("glmserve_prefix_cache_lookups_total", "source, result",
                                  "{{source}} {{result}}"),), "ops"),
    Panel("Routing decisions", (rate("glmserve_router_routing_decisions_total", "reason"),
                                rate("glmserve_router_local_prefills_total", "reason", "local prefill: {{reason}}")),
          "ops"),
    Panel("Device KV usage", ((f"glmserve_kv_cache_usage_ratio{{{M}}}", "{{role}} {{instance}}"),), "percentunit"),
    Panel("Device evictions", (rate("glmserve_kv_evictions_total", "instance"),), "ops"),
    Panel("Host tier fill", ((f"sum(glmserve_host_tier_bytes{{{M}}}) / sum(glmserve_host_tier_capacity_bytes{{{M}}})",
                              "fill"),), "percentunit"),
    Panel("Host tier writes and evictions", (rate("glmserve_host_tier_writes_total", "kind"),
                                             rate("glmserve_host_tier_evictions_total", legend="evicted")), "ops"),
    Panel("Demotions and load-backs", (rate("glmserve_host_tier_demotions_total", legend="demoted"),
                                       rate("glmserve_host_tier_loadback_blocks_total", legend="loaded back")), "ops"),
    Panel("Indexed blocks by tier", ((f"sum by (tier) (glmserve_kvstore_indexed_blocks{{{M}}})", "{{tier}}"),), "short"),
    Panel("Block index up", ((f"min(glmserve_kvstore_index_up{{{M}}})", "kvstore"),
                             (f"min(glmserve_router_kv_index_up{{{M}}})", "router")), "short", "stat"),
]

SPEC = [
    Panel("Draft acceptance (accepted / drafted)", ((
        f"sum by (instance) (rate(glmserve_spec_accepted_tokens_total{{{M}}}[{RI}]))"
        f" / (sum by (instance) (rate(glmserve_spec_draft_tokens_total{{{M}}}[{RI}])) > 0)", "{{instance}}"),),
        "percentunit", description="Counted on drafting steps only (workers that drafted nothing are left out); "
                                   "a collapse signals corrupted KV."),
    Panel("Mean tokens per verify step", ((
        f"sum(rate(glmserve_spec_acceptance_length_sum{{{M}}}[{RI}]))"
        f" / sum(rate(glmserve_spec_acceptance_length_count{{{M}}}[{RI}]))", "tokens / step"),), "short"),
    Panel("Acceptance length distribution", ((
        f"sum by (le) (increase(glmserve_spec_acceptance_length_bucket{{{M}}}[{RI}]))", "<= {{le}}"),), "short"),
    Panel("Chosen draft length k", ((
        f"sum by (le) (increase(glmserve_spec_draft_length_bucket{{{M}}}[{RI}]))", "k <= {{le}}"),), "short"),
    Panel("Drafted and accepted tokens", (rate("glmserve_spec_draft_tokens_total", legend="drafted"),
                                          rate("glmserve_spec_accepted_tokens_total", legend="accepted")), "short"),
]

FAULTS = [
    Panel("Cancelled by the client (499)", (rate("glmserve_router_requests_total", "endpoint",
                                                 selector='status="499"'),), "reqps"),
    Panel("Server errors, by status", ((
        f'sum by (status) (rate(glmserve_router_requests_total{{{M}, status=~"5.."}}[{RI}])) or vector(0)',
        "{{status}}"),), "reqps"),
    Panel("Aborts, by stage and reason", (rate("glmserve_aborts_total", "stage, reason",
                                               "{{stage}} {{reason}}"),), "ops"),
    Panel("Process restarts (15m)", ((
        "changes(process_start_time_seconds[15m]) * on (job, instance) group_left (role)"
        f" max by (job, instance, role) (glmserve_build_info{{{M}}})", "{{role}} {{instance}}"),
        (f"sum by (job, instance) (increase(glmserve_process_restarts_total{{{M}}}[15m]))",
         "{{instance}} (launcher)")), "short",
        description="New processes behind each target; '(launcher)': restarts counted by glmserve serve."),
    Panel("Targets up", (('sum by (job) (up{job=~".*glmserve.*"})', "{{job}}"),), "short"),
    Panel("Block-event publish failures", (rate("glmserve_kv_events_publish_failures_total", "instance"),), "ops"),
    Panel("Host-tier failures, by op", (rate("glmserve_host_tier_failures_total", "op"),), "ops"),
    Panel("kvstore RPC errors", (rate("glmserve_kvstore_rpc_errors_total", "rpc, code", "{{rpc}} {{code}}"),), "ops"),
]

WORKERS = [
    Panel("KV blocks used", ((f"glmserve_kv_blocks_used{{{M}}}", "{{role}} {{instance}}"),), "short"),
    Panel("KV blocks free", ((f"glmserve_kv_blocks_free{{{M}}}", "{{role}} {{instance}}"),), "short"),
    Panel("Requests running", ((f"glmserve_worker_requests_running{{{M}}}", "{{role}} {{instance}}"),), "short"),
    Panel("Requests waiting", ((f"glmserve_worker_requests_waiting{{{M}}}", "{{role}} {{instance}}"),), "short"),
    Panel("Router admission queue", ((f"sum(glmserve_router_queue_length{{{M}}})", "queued"),
                                     rate("glmserve_router_queue_wait_seconds_count", legend="waited / s")), "short",
          description="Requests waiting for a running slot on the routers, and how many per second had to wait; "
                      "its refusals are under Rejections on the SLO overview."),
    Panel("Router queue wait p99", ((
        f"histogram_quantile(0.99, sum by (le) (rate(glmserve_router_queue_wait_seconds_bucket{{{M}}}[{RI}])))",
        "p99"),), "s", description="Of the requests that waited; empty while none waits."),
    Panel("Preemptions", (rate("glmserve_worker_preemptions_total", "instance"),), "ops"),
    Panel("Queue time p99, per worker", ((
        f"histogram_quantile(0.99, sum by (le, instance) (rate(glmserve_worker_request_queue_time_seconds_bucket{{{M}}}[{RI}])))",
        "{{instance}}"),), "s"),
    Panel("Generated tokens per second, per worker",
          (rate("glmserve_worker_generation_tokens_total", "instance"),), "short"),
]

DASHBOARDS = {
    "glmserve-slo": ("glmserve / SLO overview", SLO),
    "glmserve-transfer": ("glmserve / prefill -> decode transfer", TRANSFER),
    "glmserve-cache": ("glmserve / cache tiers", CACHE),
    "glmserve-spec-decoding": ("glmserve / speculative decoding", SPEC),
    "glmserve-faults": ("glmserve / cancellations and faults", FAULTS),
    "glmserve-workers": ("glmserve / per-worker KV and queues", WORKERS),
}

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def panel_json(i: int, p: Panel) -> dict:
    return {
        "id": i + 1, "type": p.kind, "title": p.title, "description": p.description, "datasource": DATASOURCE,
        "gridPos": {"x": (i % 2) * 12, "y": (i // 2) * 8, "w": 12, "h": 8},
        "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}} if p.kind == "timeseries" else {},
        "targets": [{"refId": chr(ord("A") + j), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend}
                    for j, (expr, legend) in enumerate(p.targets)],
    }


def dashboard_json(uid: str, title: str, panels: list[Panel]) -> dict:
    return {
        "uid": uid, "title": title, "tags": ["glmserve"], "schemaVersion": 39, "version": 1, "editable": False,
        "timezone": "browser", "refresh": "10s", "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source"},
            {"name": "model_name", "type": "query", "label": "Model", "datasource": DATASOURCE,
             "query": {"query": "label_values(glmserve_build_info, model_name)", "refId": "model_name"},
             "refresh": 2, "includeAll": True, "multi": True, "allValue": ".*",
             "current": {"text": "All", "value": "$__all"}},
        ]},
        "panels": [panel_json(i, p) for i, p in enumerate(panels)],
    }


def render() -> dict[str, str]:
    """File name -> JSON text of every dashboard."""
    return {f"{uid}.json": json.dumps(dashboard_json(uid, title, panels), indent=2) + "\n"
            for uid, (title, panels) in DASHBOARDS.items()}


def main() -> int:
    OUT.mkdir(exist_ok=True)
    for name, text in render().items():
        (OUT / name).write_text(text)
    print(f"wrote {len(DASHBOARDS)} dashboards to {OUT}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
