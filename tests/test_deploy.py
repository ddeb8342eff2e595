"""deploy/: the Grafana dashboard against a live /metrics, the compose file against the compose-spec
schema, the Prometheus config, and the version and startup line operators see (docs/deploy.md).

Docker is not on this machine: the files are checked by their schemas and parsers and against each
other, not built or run."""
from __future__ import annotations

import importlib.metadata
import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import httpx
import pytest
import yaml

from test_server_util import REPO, ThreadServer, scrape_samples

DEPLOY = Path(REPO) / "deploy"
DASHBOARD = DEPLOY / "grafana" / "sparsekv.json"
# Grafana's variables as Prometheus would get them
GRAFANA_VARS = {"$__rate_interval": "1m", "$model": ".+", "${datasource}": "prometheus"}
KEY, METRICS_KEY = "sk-alice", "sk-metrics"
# what the issue lists, by the metric each panel must query
REQUIRED = {
    "device KV per request": "sparsekv:device_kv_bytes", "host KV": "sparsekv:host_kv_bytes",
    "tier hits": "sparsekv:tier_hits_total", "tier misses": "sparsekv:tier_misses_total",
    "bytes moved in": "sparsekv:h2d_bytes_total", "bytes moved out": "sparsekv:d2h_bytes_total",
    "prefix hits by tier": "sparsekv:prefix_cache_hits_total",
    "TTFT": "sparsekv:time_to_first_token_seconds_bucket", "ITL": "sparsekv:inter_token_latency_seconds_bucket",
    "TTFT by tenant": "sparsekv:tenant_time_to_first_token_seconds_bucket",
    "ITL by tenant": "sparsekv:tenant_inter_token_latency_seconds_bucket",
    "queue": "sparsekv:num_requests_waiting", "preemptions": "sparsekv:num_preemptions_total",
    "spec acceptance": "sparsekv:spec_decode_num_accepted_tokens_total",
    "KV transfer bytes": "sparsekv:disagg_transfer_bytes_total",
    "KV transfer time": "sparsekv:disagg_transfer_seconds_bucket",
    "KV transfers failed": "sparsekv:disagg_transfers_failed_total",
    "KV pool usage by data-parallel rank": "sparsekv:dp_rank_kv_cache_usage_perc",
    "requests by data-parallel rank": "sparsekv:dp_rank_num_requests_running",
}


def disaggregation_samples() -> list:
    """What a prefill or decode worker adds to /metrics (its transfer metrics), as a scrape parses it:
    the colocated server of these tests has none."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from sparsekv.disagg.metrics import TransferMetrics
    registry = CollectorRegistry()
    TransferMetrics(registry, "tiny")
    return [s for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples]


def data_parallel_samples(engine) -> list:
    """What a `-dp 2` server adds to /metrics (each rank's series, labelled `dp_rank`), as a scrape parses
    it: two ranks' entries made as the data-parallel engine makes them, from the live engine's figures."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from sparsekv.parallel.lanes import lane_summary, rank_figures
    from sparsekv.server.metrics import EngineStatsCollector
    rank = rank_figures(lane_summary(engine), engine.stats())
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector("tiny", lambda: {"by_data_parallel_rank": [rank, rank]}, lambda: True))
    return [s for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples]


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL with Grafana's variables substituted) of every target of every panel."""
    out = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for var, value in GRAFANA_VARS.items():
                expr = expr.replace(var, value)
            out.append((panel["title"], expr))
    return out


def selectors(expr: str) -> list:
    """The vector selectors of a PromQL expression, by Prometheus's grammar (promql-parser)."""
    import promql_parser
    found = []
    promql_parser.walk(promql_parser.parse(expr),
                       lambda node: found.append(node) if isinstance(node, promql_parser.VectorSelector) else None)
    return found


@pytest.fixture(scope="module")
def server():
    """The bundled model (it has an MTP layer) with tiering, drafting, a prefix host tier and tenants,
    after two requests with the same prompt: every figure the dashboard shows has been reported."""
    from sparsekv.paths import default_model_path
    with ThreadServer(default_model_path(), api_keys=[f"{KEY}:alice"], metrics_api_keys=[METRICS_KEY],
                      num_speculative_tokens=1, kv_tiering=True, prefix_cache_host_bytes=1 << 20) as srv:
        for _ in range(2):
            r = httpx.post(srv.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                           json={"prompt": "the rain in spain falls mainly on the plain", "max_tokens": 4})
            assert r.status_code == 200
        yield srv


def test_every_metric_the_dashboard_queries_is_in_a_live_scrape(server):
    samples = scrape_samples(server.url, METRICS_KEY) + disaggregation_samples() + data_parallel_samples(server.engine)
    labels: dict[str, set] = {}
    for s in samples:
        labels.setdefault(s.name, set()).update(s.labels)
    queried = set()
    for title, expr in dashboard_queries():
        for sel in selectors(expr):
            assert sel.name in labels, f"panel {title!r} queries {sel.name}, which /metrics does not have"
            for m in sel.matchers.matchers:
                assert m.name in labels[sel.name], f"panel {title!r}: {sel.name} has no label {m.name}"
            queried.add(sel.name)
    missing = {what: name for what, name in REQUIRED.items() if name not in queried}
    assert not missing, f"the dashboard shows none of {missing}"


def test_latency_panels_show_p50_and_p99_overall_and_by_tenant():
    quantiles: dict[str, set] = {}
    for _, expr in dashboard_queries():
        for q, metric in re.findall(r"histogram_quantile\((0\.\d+), .*?(sparsekv:\w+_bucket)", expr):
            quantiles.setdefault(metric, set()).add(q)
            if "tenant_" in metric:
                assert "by (le, tenant)" in expr, expr
    for what in ("TTFT", "ITL", "TTFT by tenant", "ITL by tenant"):
        assert quantiles.get(REQUIRED[what]) == {"0.5", "0.99"}, what


def test_the_dashboard_is_one_grafana_model_with_unique_ids():
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and dash["uid"] == "sparsekv"
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource", "model"}
    for p in dash["panels"]:
        assert p["gridPos"]["w"] <= 24 and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]
        refs = [t["refId"] for t in p.get("targets", [])]
        assert len(refs) == len(set(refs)), p["title"]


def test_dashboard_queries_that_name_a_missing_metric_fail():
    """The check above can fail: a query naming a metric /metrics lacks is caught by name."""
    names = {sel.name for _, expr in dashboard_queries() for sel in selectors(expr)}
    assert "sparsekv:no_such_metric" not in names
    assert [s.name for s in selectors('rate(sparsekv:no_such_metric{model_name=~".+"}[1m])')] == ["sparsekv:no_such_metric"]


# -- compose, Prometheus, Grafana provisioning, Dockerfile --------------------------------------

def _compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def _interpolate(word: str) -> str:
    """Compose's ${VAR:-default} as it reads with VAR unset."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", word)


def test_the_compose_file_matches_the_compose_spec_schema():
    pytest.importorskip("check_jsonschema")
    import importlib.resources

    import jsonschema
    schema = json.loads((importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
                         / "compose-spec.json").read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    compose = _compose()
    assert list(validator.iter_errors(compose)) == []
    broken = {**compose, "services": {**compose["services"], "grafana": {**compose["services"]["grafana"],
                                                                          "portz": ["3000:3000"]}}}
    assert any("portz" in e.message for e in validator.iter_errors(broken))  # the schema does reject


def test_compose_services_point_at_each_other_and_at_files_that_exist():
    from sparsekv.__main__ import parser_for
    services = _compose()["services"]
    command = [_interpolate(w) for w in services["sparsekv"]["command"]]
    parser, argv = parser_for(command)
    args = parser.parse_args(argv)  # the real `sparsekv serve` parser
    assert (args.host, args.device) == ("0.0.0.0", "cuda") and (DEPLOY.parent / args.model).is_dir()
    prometheus = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert prometheus["scrape_configs"][0]["static_configs"][0]["targets"] == [f"sparsekv:{args.port}"]
    mounts = {}
    for name in ("prometheus", "grafana"):
        for volume in services[name]["volumes"]:
            source, target = volume.split(":")[:2]
            if source.startswith("./"):
                assert (DEPLOY / source).exists(), volume
                mounts[target] = DEPLOY / source
    assert mounts["/etc/prometheus/prometheus.yml"] == DEPLOY / "prometheus" / "prometheus.yml"
    provider = yaml.safe_load((mounts["/etc/grafana/provisioning"] / "dashboards" / "sparsekv.yml").read_text())
    path = provider["providers"][0]["options"]["path"]
    assert mounts[path + "/sparsekv.json"].resolve() == DASHBOARD.resolve()
    source = yaml.safe_load((mounts["/etc/grafana/provisioning"] / "datasources" / "prometheus.yml").read_text())
    assert source["datasources"][0]["url"] == "http://prometheus:9090" and "prometheus" in services


def test_the_prometheus_config_is_well_formed():
    """A structural check (PyYAML): durations, unique job names, host:port targets; and promtool's own
    `check config` where Prometheus is installed."""
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert set(config) <= {"global", "scrape_configs", "rule_files", "alerting"}
    for key in ("scrape_interval", "evaluation_interval"):
        assert re.fullmatch(r"\d+(ms|s|m|h)", config["global"][key]), key
    jobs = [job["job_name"] for job in config["scrape_configs"]]
    assert len(jobs) == len(set(jobs))
    for job in config["scrape_configs"]:
        assert job.get("metrics_path", "/metrics") == "/metrics"
        for static in job["static_configs"]:
            assert all(re.fullmatch(r"[\w.-]+:\d+", t) for t in static["targets"])
    if shutil.which("promtool"):
        check = subprocess.run(["promtool", "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")],
                               capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr


def test_the_dockerfile_serves_on_the_compose_port_with_the_real_parser():
    from sparsekv.__main__ import parser_for
    text = (DEPLOY / "Dockerfile").read_text()
    entrypoint = json.loads(re.search(r"^ENTRYPOINT (.*)$", text, re.M).group(1))
    cmd = json.loads(re.search(r"^CMD (.*)$", text, re.M).group(1))
    assert entrypoint == ["sparsekv"]
    parser, argv = parser_for(cmd)
    args = parser.parse_args(argv)
    assert f"EXPOSE {args.port}" in text and args.device == "cuda"
    for path in re.findall(r"^COPY (\S+) ", text, re.M):
        assert (DEPLOY.parent / path).exists(), path


# -- the version and the startup line ---------------------------------------------------------

def test_version_flag_and_endpoint_agree_with_the_package(server, capsys):
    from sparsekv.__main__ import main
    assert main(["--version"]) == 0
    printed = capsys.readouterr().out.strip()
    pyproject = tomllib.loads((Path(REPO) / "pyproject.toml").read_text())["project"]["version"]
    assert printed == httpx.get(server.url + "/version").json()["version"] == pyproject
    assert printed == importlib.metadata.version("sparsekv")


def test_generate_logs_one_line_of_the_settings_that_differ_from_their_defaults(capsys):
    from sparsekv.__main__ import main
    assert main(["generate", "--prompt-token-ids", "1,2,3", "--max-tokens", "2", "--seed", "3", "--json",
                 "--max-model-len", "128"]) == 0
    first = capsys.readouterr().err.splitlines()[0]
    version = importlib.metadata.version("sparsekv")
    assert first == (f"sparsekv {version}, non-default args: "
                     "{'max_tokens': 2, 'json': True, 'max_model_len': 128, 'seed': 3}")


def test_server_info_gives_bench_serving_the_mean_acceptance_length(server):
    """SGLang's bench_serving prints "Accept length" from /server_info's
    internal_states[0]["avg_spec_accept_length"]: the drafting server's mean acceptance length, the
    figure /metrics derives from its spec_decode counters."""
    info = httpx.get(server.url + "/server_info", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
    stats = server.engine.stats()
    length = info["internal_states"][0]["avg_spec_accept_length"]
    assert length == stats["spec_decode_mean_acceptance_length"] >= 1.0
    assert length == 1 + stats["spec_decode_num_accepted_tokens"] / stats["spec_decode_num_drafts"]
    assert info["num_speculative_tokens"] == "1" and info["kv_tiering"] == "True"
