"""The Grafana dashboards match what the processes export: every metric family has a panel, every
query tells the primary from the shadow, every query reads the chosen data source and keeps to the
chosen namespace, pod and instance (template variables), and every panel's query returns data
from a real Prometheus (Debian's ``prometheus``) scraping a primary under load with a shadow
running (both scraped with deploy/prometheus.yml's jobs and labels)."""

import json
import re
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import yaml

from loadtest.localserver import free_port, start_server, stop_server
from service.http.metrics import Metrics
from tests.conftest import need_tool

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARDS = DEPLOY / "grafana" / "dashboards"
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
TOKEN = "dashboards-token"
TEXTS = ["libc6: GNU C Library: Shared libraries", "python3: interactive high-level language", "vim editor"]
# The scope every query keeps to: Grafana's template variables (all of them by default).
SELECTORS = ("namespace", "pod", "instance")
DATA_SOURCE = {"type": "prometheus", "uid": "${datasource}"}
METRIC = re.compile(r"\b(?:xmcserve|process|python|ray)_[a-z_]+(\{[^}]*\})?")


def queries(name: str) -> list[tuple[str, str]]:
    """(panel title, expression) of every query of a dashboard."""
    dashboard = json.loads((DASHBOARDS / name).read_text())
    return [(p["title"], t["expr"]) for p in dashboard["panels"] if p["type"] != "row" for t in p["targets"]]


def promql(expr: str, **chosen: str) -> str:
    """The expression as Grafana sends it: each variable replaced by its choice, or by its "All"
    value (``.*``, which also matches a series without the label, as a compose stack's)."""
    for name in SELECTORS:
        expr = expr.replace(f"${name}", chosen.get(name, ".*"))
    return expr


def test_every_query_reads_the_chosen_data_source_and_keeps_to_the_chosen_pods():
    for name in ("xmcserve.json", "xmcserve-ray.json"):
        dashboard = json.loads((DASHBOARDS / name).read_text())
        variables = {v["name"]: v for v in dashboard["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
        for label in SELECTORS:
            variable = variables[label]
            assert variable["datasource"] == DATA_SOURCE and f", {label})" in variable["definition"]
            assert variable["includeAll"] and variable["allValue"] == ".*"
        # each selector's choices narrowed by the ones before it
        assert 'namespace=~"$namespace"' in variables["pod"]["definition"]
        assert 'pod=~"$pod"' in variables["instance"]["definition"]
        for panel in dashboard["panels"]:
            if panel["type"] == "row":
                continue
            assert panel["datasource"] == DATA_SOURCE, panel["title"]
            for target in panel["targets"]:
                assert target["datasource"] == DATA_SOURCE, panel["title"]
                metrics = METRIC.findall(target["expr"])
                assert metrics, target["expr"]
                for braces in metrics:
                    for label in SELECTORS:
                        assert f'{label}=~"${label}"' in braces, (panel["title"], target["expr"])


def ray_ingress_families() -> set[str]:
    """The ingress's series as Ray's metrics agent exports them (``ray_`` + the name given)."""
    source = (DEPLOY.parent / "service" / "ray_serve" / "app.py").read_text()
    import re

    names = re.findall(r'ray_metrics\.\w+\(\s*"([a-z_]+)"', source)
    assert names, "no Ray metrics found in service/ray_serve/app.py"
    return {f"ray_{name}" for name in names}


def test_every_metric_family_the_server_exports_has_a_panel():
    exprs = " ".join(e for _, e in queries("xmcserve.json"))
    families = {family.name for family in Metrics().registry.collect()}
    assert {f for f in families if f not in exprs} == set()


def test_every_ray_ingress_metric_has_a_panel():
    exprs = " ".join(e for _, e in queries("xmcserve-ray.json"))
    assert {f for f in ray_ingress_families() if f not in exprs} == set()


def test_every_query_tells_the_primary_from_the_shadow():
    """Both scrape jobs export the same series: a query without the role would add the shadow's
    own traffic into the primary's."""
    for title, expr in queries("xmcserve.json"):
        assert "role=" in expr or "by (role" in expr, (title, expr)
    jobs = {job["job_name"]: job for job in yaml.safe_load((DEPLOY / "prometheus.yml").read_text())["scrape_configs"]}
    roles = {job["static_configs"][0]["labels"]["role"] for job in jobs.values()}
    assert roles == {"primary", "shadow"}


def scrape_config(primary: str, shadow: str) -> dict:
    """deploy/prometheus.yml with the compose targets replaced by the test's processes."""
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = "1s"
    targets = {"primary": primary, "shadow": shadow}
    for job in config["scrape_configs"]:
        static = job["static_configs"][0]
        static["targets"] = [targets[static["labels"]["role"]].removeprefix("http://")]
    return config


def load(url: str, seconds: float) -> None:
    """Predictions from 4 clients, a few refusals, one reload and one append (bounded in time)."""
    admin = {"X-Admin-Token": TOKEN}
    with httpx.Client(base_url=url, timeout=30) as client:
        client.post("/admin/reload", json={"variant": "B", "bundle": "tiny-rae"}, headers=admin).raise_for_status()
        client.post(
            "/admin/append",
            json={"variant": "A", "labels": [{"uid": "dash-new", "text": "a label added by the dashboard check"}]},
            headers=admin,
        ).raise_for_status()
        client.post("/predict", json={"text": "x", "k": 0})  # a 422
    deadline = time.monotonic() + seconds

    def client_loop(offset: int) -> int:
        sent = 0
        with httpx.Client(base_url=url, timeout=30) as client:
            while time.monotonic() < deadline and sent < 5000:
                client.post("/predict", json={"texts": TEXTS[offset % 3 :], "k": 5})
                sent += 1
        return sent

    with ThreadPoolExecutor(4) as pool:
        assert sum(pool.map(client_loop, range(4))) > 100


def check_the_selectors(port: int, primary: str, shadow: str) -> None:
    """The instance variable lists both processes, and choosing one keeps the other out."""
    base = f"http://127.0.0.1:{port}/api/v1"
    dashboard = json.loads((DASHBOARDS / "xmcserve.json").read_text())
    (instance,) = [v for v in dashboard["templating"]["list"] if v["name"] == "instance"]
    # Grafana's label_values(selector, label): the label's values among the selector's series
    selector, label = re.fullmatch(r"label_values\((.*), (\w+)\)", instance["definition"]).groups()
    series = httpx.get(f"{base}/series", params={"match[]": promql(selector)}, timeout=10).json()["data"]
    listed = {s[label] for s in series}
    primary_at, shadow_at = primary.removeprefix("http://"), shadow.removeprefix("http://")
    assert {primary_at, shadow_at} <= listed, listed
    by_role, _ = [expr for title, expr in queries("xmcserve.json") if title == "Memory: resident and virtual"]
    for chosen, role in ((primary_at, "primary"), (shadow_at, "shadow")):
        result = httpx.get(f"{base}/query", params={"query": promql(by_role, instance=chosen)}, timeout=10).json()
        assert [r["metric"]["role"] for r in result["data"]["result"]] == [role]


def test_every_panel_has_data_under_load(bundle_root, tmp_path):
    need_tool(Path(PROMETHEUS).exists(), "no prometheus binary (Debian: apt-get install prometheus)")
    shadow = start_server(bundle_root / "tiny-rae", tmp_path / "shadow.log")
    env = {
        "XMCSERVE_SHADOW_URL": shadow.url,
        "XMCSERVE_SHADOW_FRACTION": "1",
        "XMCSERVE_ADMIN_TOKEN": TOKEN,
        "XMCSERVE_BUNDLE_ROOT": str(bundle_root),
        "XMCSERVE_APPEND_LOG_DIR": str(tmp_path / "appends"),
    }
    prometheus = None
    try:
        primary = start_server(bundle_root / "tiny-rae", tmp_path / "primary.log", env)
        try:
            (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(scrape_config(primary.url, shadow.url)))
            port = free_port()
            prometheus = subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={tmp_path / 'prometheus.yml'}",
                    f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                ],
                stdout=subprocess.DEVNULL,
                stderr=(tmp_path / "prometheus.log").open("w"),
            )
            load(primary.url, seconds=12)
            api = f"http://127.0.0.1:{port}/api/v1/query"
            empty: list = []
            for _ in range(20):  # scrapes every second; a rate needs two samples in its window
                empty = []
                for title, expr in queries("xmcserve.json"):
                    result = httpx.get(api, params={"query": promql(expr)}, timeout=10).json()
                    assert result["status"] == "success", (title, expr, result)
                    if not result["data"]["result"]:
                        empty.append((title, expr))
                if not empty:
                    break
                time.sleep(1)
            assert empty == [], empty
            print(f"dashboard check: {len(queries('xmcserve.json'))} queries, every one with data")
            check_the_selectors(port, primary.url, shadow.url)
        finally:
            stop_server(primary)
    finally:
        if prometheus is not None:
            prometheus.terminate()
            prometheus.wait(timeout=15)
        stop_server(shadow)
