"""The deploy files agree with the service: ports, env names, probe paths, metric names, no torch
in the serving image. (No Docker engine or cluster runs here; these are the checks that can.)"""

import json
import re
from pathlib import Path

import pytest
import yaml

from service.http.app import create_app
from service.http.metrics import Metrics
from service.http.settings import Settings, environment_variables
from tests.deploy.conftest import assert_hadolint_clean

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SETTING_NAMES = set(environment_variables())
ROUTES = {route.path for route in create_app(Settings()).routes}
SERVING_IMAGE = "xmcserve-serve:0.1.0"


def load(path: Path):
    return yaml.safe_load(path.read_text())


def k8s(kind: str, name: str = "xmcserve") -> dict:
    docs = [d for p in sorted((DEPLOY / "k8s").rglob("*.yaml")) for d in yaml.safe_load_all(p.read_text())]
    matches = [d for d in docs if d and d["kind"] == kind and d["metadata"]["name"].startswith(name)]
    matches = [d for d in matches if d["metadata"]["name"] == name] or matches
    assert len(matches) == 1, (kind, name)
    return matches[0]


def test_k8s_wires_the_primary_to_a_shadow_service_of_its_own():
    url = k8s("ConfigMap")["data"]["XMCSERVE_SHADOW_URL"]
    service = k8s("Service", "xmcserve-shadow")
    assert url == f"http://{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
    shadow = k8s("Deployment", "xmcserve-shadow")
    assert service["spec"]["selector"] == shadow["spec"]["selector"]["matchLabels"]
    container = shadow["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["requests"]["cpu"]  # CPU of its own, not the primary's
    assert {e["name"] for e in container["env"]} <= SETTING_NAMES


def test_compose_services_and_dependencies():
    compose = load(ROOT / "docker-compose.yml")
    services = compose["services"]
    assert {"bundle", "api", "shadow", "prometheus", "grafana", "locust-master", "locust-worker"} <= set(services)
    for name in ("api", "shadow"):
        service = services[name]
        assert service["image"] == SERVING_IMAGE and service["build"]["dockerfile"] == "deploy/Dockerfile"
        assert set(service["environment"]) <= SETTING_NAMES, set(service["environment"]) - SETTING_NAMES
        assert "bundles:/bundles:ro" in service["volumes"]
        assert "/readyz" in " ".join(service["healthcheck"]["test"])
        assert service["depends_on"]["bundle"]["condition"] == "service_completed_successfully"
    api = services["api"]
    assert api["ports"] == ["127.0.0.1:8000:8000"]
    assert api["depends_on"]["shadow"]["condition"] == "service_healthy"
    assert api["environment"]["XMCSERVE_SHADOW_URL"] == "http://shadow:8000"
    assert services["prometheus"]["depends_on"]["api"]["condition"] == "service_healthy"
    assert "--master-host" in services["locust-worker"]["command"]
    assert services["locust-master"]["command"][-1] == "http://api:8000"


def test_prometheus_scrapes_api_and_shadow_metrics():
    config = load(DEPLOY / "prometheus.yml")
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert targets == {"api:8000", "shadow:8000"}
    assert all(job["metrics_path"] == "/metrics" for job in config["scrape_configs"])
    assert "/metrics" in ROUTES


def exported_series_names() -> set[str]:
    """The sample names a live registry exports once every labelled metric has one observation
    (prometheus-client leaves out ``_sum`` for a histogram with negative buckets, so the names
    come from the samples themselves, not from the metric types)."""
    metrics = Metrics()
    for collector in vars(metrics).values():
        labelnames = getattr(collector, "_labelnames", None)
        if labelnames is None:
            continue
        child = collector.labels(**{name: "x" for name in labelnames}) if labelnames else collector
        for action in ("observe", "inc", "set", "info"):
            if hasattr(child, action):
                getattr(child, action)({"k": "v"} if action == "info" else 0.5)
                break
    metrics.appended_keys_of = lambda: [("x", 1, 1)]  # read from the served memories at each scrape
    return {sample.name for family in metrics.registry.collect() for sample in family.samples}


def test_grafana_dashboard_uses_real_metric_names():
    dashboard = json.loads((DEPLOY / "grafana/dashboards/xmcserve.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"\bxmcserve_[a-z_]+", e)}
    exported = exported_series_names()
    assert "xmcserve_shadow_rank_correlation_sum" not in exported  # negative buckets: no _sum
    assert used and used <= exported, used - exported
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("qps", "latency", "stage", "batch", "queue", "overlap", "errors"):
        assert topic in titles


def test_k8s_grace_period_covers_the_drain():
    deployment = k8s("Deployment")
    spec = deployment["spec"]["template"]["spec"]
    pre_stop = spec["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    drain = int(k8s("ConfigMap")["data"]["XMCSERVE_GRACEFUL_SHUTDOWN_S"])
    assert pre_stop[0] == "sleep" and spec["terminationGracePeriodSeconds"] > int(pre_stop[1]) + drain


def test_k8s_deployment_probes_ports_and_config():
    deployment = k8s("Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["ports"][0]["containerPort"] == 8000
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert {"/readyz", "/healthz"} <= ROUTES
    assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]
    assert container["envFrom"][0]["configMapRef"]["name"] == k8s("ConfigMap")["metadata"]["name"]
    assert set(k8s("ConfigMap")["data"]) <= SETTING_NAMES
    assert {e["name"] for e in container["env"]} <= SETTING_NAMES
    assert any(m["mountPath"] == "/bundles" and m["readOnly"] for m in container["volumeMounts"])
    assert k8s("HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert k8s("Service")["spec"]["ports"][0]["targetPort"] == "http"
    job = k8s("Job", "xmcserve-build-bundle")["spec"]["template"]["spec"]
    claim = k8s("PersistentVolumeClaim")["metadata"]["name"]
    assert job["volumes"][0]["persistentVolumeClaim"]["claimName"] == claim
    assert "export.build" in " ".join(job["containers"][0]["command"])


def run_lines(dockerfile: Path) -> str:
    text = dockerfile.read_text().replace("\\\n", " ")
    return "\n".join(line for line in text.splitlines() if line.startswith("RUN"))


@pytest.mark.parametrize(("dockerfile", "extra"), [("Dockerfile", "cpu"), ("Dockerfile.gpu", "gpu")])
def test_serving_images_install_no_torch_and_run_unprivileged(dockerfile, extra):
    path = DEPLOY / dockerfile
    runs = run_lines(path)
    assert not re.search(r"torch|transformers|\.\[(train|export)", runs), runs
    assert f'pip install ".[{extra}]"' in runs
    text = path.read_text()
    assert re.search(r"^USER (?!root|0\b)", text, re.M)
    assert "HEALTHCHECK" in text and "/readyz" in text
    assert "torch==" in run_lines(DEPLOY / "Dockerfile.train")


def test_the_cuda_image_runs_on_a_cuda_runtime_and_insists_on_cuda():
    text = (DEPLOY / "Dockerfile.gpu").read_text()
    # CUDA 13: what PyPI's onnxruntime-gpu (1.31.1) links against; a CUDA 12 base cannot create its provider
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:13\.[0-9.]+-cudnn-runtime-", text, re.M)
    assert re.findall(r"^FROM (\S+)", text, re.M) == ["${CUDA_IMAGE}", "${CUDA_IMAGE}"]
    assert "XMCSERVE_PROVIDERS=cuda" in text


def test_onnxruntime_builds_are_extras_that_never_meet():
    """onnxruntime and onnxruntime-gpu install the same module: the core installs neither, the
    cpu extra one, the gpu extra the other."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {key: [re.split(r"[<>=\[]", r)[0] for r in reqs] for key, reqs in project["optional-dependencies"].items()}
    core = [re.split(r"[<>=\[]", r)[0] for r in project["dependencies"]]
    assert "onnxruntime" not in core and "onnxruntime-gpu" not in core
    assert "onnxruntime" in names["cpu"] and "onnxruntime-gpu" not in names["cpu"]
    assert "onnxruntime-gpu" in names["gpu"] and "onnxruntime" not in names["gpu"]


@pytest.mark.parametrize(
    "dockerfile", ["Dockerfile", "Dockerfile.gpu", "Dockerfile.train", "Dockerfile.ray", "Dockerfile.loadtest"]
)
def test_dockerfiles_pass_hadolint(dockerfile):
    assert_hadolint_clean(DEPLOY / dockerfile)


# --- the Ray Serve deployment: deploy/ray/serve-config.yaml and deploy/k8s/ray/rayservice.yaml ---

K8S_VERSION = "1.33"
CUSTOM_KINDS = {"RayService", "ServiceMonitor"}  # KubeRay's and the Prometheus Operator's CRDs


def k8s_documents() -> list[dict]:
    return [d for p in sorted((DEPLOY / "k8s").rglob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]


def ray_pin() -> str:
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return next(r for r in extras["ray"] if r.startswith("ray[serve]==")).split("==")[1]


def pod_templates(rayservice: dict) -> dict[str, dict]:
    cluster = rayservice["spec"]["rayClusterConfig"]
    groups = {"head": cluster["headGroupSpec"]} | {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    return {name: group["template"] for name, group in groups.items()}


def test_every_k8s_object_and_ray_pod_template_passes_kubernetes_validate():
    """The core objects against the Kubernetes schema (strict: unknown fields fail); RayService
    and ServiceMonitor are custom resources, so the RayService's pod templates are checked as
    the Pods KubeRay makes of them."""
    import kubernetes_validate

    documents = k8s_documents()
    for document in documents:
        if document["kind"] not in CUSTOM_KINDS:
            kubernetes_validate.validate(document, K8S_VERSION, strict=True)
    for name, template in pod_templates(k8s("RayService", "xmcserve-ray")).items():
        metadata = {**template["metadata"], "name": name}
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": template["spec"]}
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    broken = {**k8s("Service"), "spec": {**k8s("Service")["spec"], "portz": []}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def serve_configs() -> dict[str, dict]:
    rayservice = k8s("RayService", "xmcserve-ray")
    return {
        "serve-config.yaml": load(DEPLOY / "ray" / "serve-config.yaml"),
        "rayservice.yaml": yaml.safe_load(rayservice["spec"]["serveConfigV2"]),
    }


@pytest.mark.parametrize("name", ["serve-config.yaml", "rayservice.yaml"])
def test_the_serve_configs_are_valid_for_ray_serve_and_for_the_app(name):
    from ray.serve.schema import ServeDeploySchema

    from service.ray_serve import AppArgs

    config = ServeDeploySchema.model_validate(serve_configs()[name])
    (application,) = config.applications
    assert application.import_path == "service.ray_serve:build_app"
    args = AppArgs.model_validate(application.args)
    assert application.route_prefix == "/" and config.http_options.port == 8000
    shards = 2  # both configs serve the sample bundle built in 2 shards
    names = {"ingress", "encoder"} | {f"shard-{i}" for i in range(shards)}
    assert {d.name for d in application.deployments} <= names
    assert args.bundle_dir.name in {"default-2shards", "sharded"}


def test_the_rayservice_matches_the_bundle_job_the_image_and_the_ray_pin():
    rayservice = k8s("RayService", "xmcserve-ray")
    cluster = rayservice["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == ray_pin()
    assert f"rayproject/ray:{ray_pin()}-" in (DEPLOY / "Dockerfile.ray").read_text()
    args = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"][0]["args"]
    job = k8s("Job", "xmcserve-build-sharded-bundle")["spec"]["template"]["spec"]["containers"][0]["command"]
    assert job[job.index("--out") + 1] == args["bundle_dir"]
    shards = int(job[job.index("--shards") + 1])
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    shard_group = groups["shards"]
    offered = json.loads(json.loads(shard_group["rayStartParams"]["resources"]))
    assert set(args["shard_resources"]) <= set(offered)
    per_pod = min(offered[r] // args["shard_resources"][r] for r in args["shard_resources"])
    assert shard_group["replicas"] * per_pod >= shards * args["shard_replicas"]  # room for every shard replica
    assert float(shard_group["rayStartParams"]["num-cpus"]) >= per_pod * args["shard_cpus"]
    encoders = groups["encoders"]
    assert float(encoders["rayStartParams"]["num-cpus"]) * encoders["replicas"] >= (
        args["encoder_replicas"] * args["encoder_cpus"] + args["ingress_replicas"] * args["ingress_cpus"]
    )
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # the head runs no replica
    for name, template in pod_templates(rayservice).items():
        container = template["spec"]["containers"][0]
        assert container["image"] == "xmcserve-ray:0.1.0", name
        assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"], name
        assert any(m["mountPath"] == "/bundles" and m["readOnly"] for m in container["volumeMounts"]), name
        assert (
            template["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"]
            == k8s("PersistentVolumeClaim")["metadata"]["name"]
        )


def test_the_100m_rayservice_validates_and_holds_every_shard_replica_in_its_measured_memory():
    """deploy/k8s/ray-100m: the 10^8-label plan of docs/architecture.md. Its pod templates pass
    kubernetes-validate as the Pods KubeRay makes; its Serve config is a valid application of 16
    shards x 2 replicas that fits the shard group; a shard pod's memory request covers what a
    6.25 M-label shard replica was measured to hold here (bench/results/shard-replica.json)."""
    import kubernetes_validate
    from ray.serve.schema import ServeDeploySchema

    from service.ray_serve import AppArgs

    rayservice = k8s("RayService", "xmcserve-ray-100m")
    for name, template in pod_templates(rayservice).items():
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {**template["metadata"], "name": name}}
        kubernetes_validate.validate({**pod, "spec": template["spec"]}, K8S_VERSION, strict=True)
    config = ServeDeploySchema.model_validate(yaml.safe_load(rayservice["spec"]["serveConfigV2"]))
    args = AppArgs.model_validate(config.applications[0].args)
    cluster = rayservice["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == ray_pin()
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    shards = 16  # 10^8 / 6.25 M
    assert groups["shards"]["replicas"] == groups["shards"]["minReplicas"] == shards * args.shard_replicas
    assert args.shard_max_replicas_per_node == 1 and args.shard_resources == {"shard_host": 1}
    encoders = groups["encoders"]
    assert float(encoders["rayStartParams"]["num-cpus"]) * encoders["replicas"] >= (
        args.encoder_replicas * args.encoder_cpus + args.ingress_replicas * args.ingress_cpus
    )
    measured = json.loads((ROOT / "bench" / "results" / "shard-replica.json").read_text())
    assert measured["labels"] * shards == 100_000_000
    request = groups["shards"]["template"]["spec"]["containers"][0]["resources"]["requests"]["memory"]
    assert int(request.removesuffix("Gi")) >= measured["replica"]["after_search"]["peak_rss_gib"] + 0.5
