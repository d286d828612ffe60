"""The Kubernetes manifests apply cleanly and come up: restricted Pod Security on every pod,
bundles that the Jobs build before any pod serves them, storage that default classes offer, a
ServiceMonitor beside the scrape annotations; and the compose stack's grace and Grafana files."""

import copy
import json
from pathlib import Path

import pytest
import yaml

from service.http.app import create_app
from service.http.settings import ServerSettings, Settings

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
# The restricted Pod Security Standard's allowed volume types
# (https://kubernetes.io/docs/concepts/security/pod-security-standards/#restricted)
RESTRICTED_VOLUMES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret",
}  # fmt: skip


def documents(folder: Path = K8S) -> list[dict]:
    return [d for p in sorted(folder.rglob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]


def find(kind: str, name: str) -> dict:
    (match,) = [d for d in documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    return match


def pod_templates() -> dict[str, dict]:
    """Every pod spec the manifests make: Deployments, Jobs and the RayService's groups."""
    out = {}
    for d in documents():
        if d["kind"] in ("Deployment", "Job"):
            out[f"{d['kind']}/{d['metadata']['name']}"] = d["spec"]["template"]["spec"]
        elif d["kind"] == "RayService":
            cluster, name = d["spec"]["rayClusterConfig"], d["metadata"]["name"]
            out[f"RayService/{name}/head"] = cluster["headGroupSpec"]["template"]["spec"]
            for group in cluster["workerGroupSpecs"]:
                out[f"RayService/{name}/{group['groupName']}"] = group["template"]["spec"]
    return out


def restricted_violations(pod: dict) -> list[str]:
    """What the restricted Pod Security Standard would reject in a pod spec."""
    problems = []
    pod_sc = pod.get("securityContext", {})
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            problems.append(field)
    for volume in pod.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            problems.append(f"volume {volume['name']}: {kinds}")
    for container in pod.get("initContainers", []) + pod["containers"]:
        sc = container.get("securityContext", {})
        name = container["name"]
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{name}: allowPrivilegeEscalation must be false")
        if sc.get("privileged"):
            problems.append(f"{name}: privileged")
        if "ALL" not in sc.get("capabilities", {}).get("drop", []):
            problems.append(f"{name}: capabilities must drop ALL")
        if set(sc.get("capabilities", {}).get("add", [])) - {"NET_BIND_SERVICE"}:
            problems.append(f"{name}: adds capabilities")
        if not sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
            problems.append(f"{name}: runAsNonRoot")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            problems.append(f"{name}: runs as uid 0")
        seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            problems.append(f"{name}: seccompProfile {seccomp}")
    return problems


@pytest.mark.parametrize("name", sorted(pod_templates()))
def test_every_pod_meets_the_restricted_pod_security_standard(name):
    assert restricted_violations(pod_templates()[name]) == []


def test_the_restricted_check_catches_what_it_checks():
    pod = copy.deepcopy(pod_templates()["Deployment/xmcserve"])
    assert restricted_violations(pod) == []
    pod["containers"][0]["securityContext"] = {"allowPrivilegeEscalation": False}
    del pod["securityContext"]["seccompProfile"]
    pod["volumes"].append({"name": "host", "hostPath": {"path": "/"}})
    problems = " ".join(restricted_violations(pod))
    for expected in ("drop ALL", "seccompProfile", "hostPath"):
        assert expected in problems


@pytest.mark.parametrize("name", ["Deployment/xmcserve", "Deployment/xmcserve-shadow", "Job/xmcserve-build-bundle"])
def test_xmcserve_containers_run_on_a_read_only_root_filesystem(name):
    pod = pod_templates()[name]
    for container in pod.get("initContainers", []) + pod["containers"]:
        assert container["securityContext"]["readOnlyRootFilesystem"] is True, container["name"]
    writable = {m["mountPath"] for c in pod["containers"] for m in c["volumeMounts"] if not m.get("readOnly")}
    assert "/tmp" in writable


def job_outputs(name: str) -> set[str]:
    command = " ".join(find("Job", name)["spec"]["template"]["spec"]["containers"][0]["command"])
    return {part.split()[0] for part in command.split("--out ")[1:]}


def env_of(container: dict) -> dict[str, str]:
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    for source in container.get("envFrom", []):
        env |= find("ConfigMap", source["configMapRef"]["name"])["data"]
    return env


@pytest.mark.parametrize("deployment", ["xmcserve", "xmcserve-shadow"])
def test_each_deployment_serves_a_bundle_the_job_builds_and_waits_for_it(deployment):
    pod = find("Deployment", deployment)["spec"]["template"]["spec"]
    bundle = env_of(pod["containers"][0])["XMCSERVE_BUNDLE_DIR"]
    assert bundle in job_outputs("xmcserve-build-bundle")
    (wait,) = pod["initContainers"]
    script = " ".join(wait["command"]).replace("$XMCSERVE_BUNDLE_DIR", env_of(wait).get("XMCSERVE_BUNDLE_DIR", "?"))
    assert f"test -f {bundle}/manifest.json" in script.replace('"', "")
    assert wait["image"] == pod["containers"][0]["image"]


@pytest.mark.parametrize("rayservice_name", ["xmcserve-ray", "xmcserve-ray-100m"])
def test_every_ray_pod_waits_for_the_sharded_bundle_before_the_app_deploys(rayservice_name):
    rayservice = find("RayService", rayservice_name)
    bundle = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"][0]["args"]["bundle_dir"]
    if rayservice_name == "xmcserve-ray":  # the 10^8 bundle is built where its catalogue is, not by a Job
        assert bundle in job_outputs("xmcserve-build-sharded-bundle")
    for name, pod in pod_templates().items():
        if name.startswith(f"RayService/{rayservice_name}/"):
            commands = [" ".join(c["command"]) for c in pod["initContainers"]]
            assert any(f"test -f {bundle}/manifest.json" in c for c in commands), name


def test_the_bundle_volume_uses_an_access_mode_default_storage_classes_offer():
    assert find("PersistentVolumeClaim", "xmcserve-bundles")["spec"]["accessModes"] == ["ReadWriteOnce"]


def test_custom_resources_live_apart_from_the_core_manifests():
    """`kubectl apply -f deploy/k8s/` must work on a cluster without KubeRay or the Prometheus
    Operator: their kinds sit in sub-folders applied on their own."""
    core = [d for p in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]
    assert {d["apiVersion"].split("/")[0] for d in core} <= {"v1", "apps", "batch", "autoscaling"}
    assert find("RayService", "xmcserve-ray") and find("ServiceMonitor", "xmcserve")


def test_a_service_monitor_scrapes_both_services_metrics():
    monitor = find("ServiceMonitor", "xmcserve")
    (expression,) = monitor["spec"]["selector"]["matchExpressions"]
    routes = {route.path for route in create_app(Settings()).routes}
    for service_name in ("xmcserve", "xmcserve-shadow"):
        service = find("Service", service_name)
        assert service["metadata"]["labels"][expression["key"]] in expression["values"]
        port_names = {p["name"] for p in service["spec"]["ports"]}
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint["port"] in port_names and endpoint["path"] in routes


# --- compose and Grafana (the stack's parts that do not run here are checked statically) ---


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


@pytest.mark.parametrize("service", ["api", "shadow"])
def test_compose_gives_the_server_time_to_drain(service):
    spec = compose()["services"][service]
    drain = int(spec.get("environment", {}).get("XMCSERVE_GRACEFUL_SHUTDOWN_S", ServerSettings().graceful_shutdown_s))
    grace = spec["stop_grace_period"]
    assert grace.endswith("s") and int(grace[:-1]) > drain
    assert spec["read_only"] is True and "/tmp" in spec["tmpfs"]


def test_grafana_provisioning_points_at_the_stack():
    services = compose()["services"]
    provisioning = ROOT / "deploy/grafana/provisioning"
    (datasource,) = yaml.safe_load((provisioning / "datasources/prometheus.yml").read_text())["datasources"]
    assert datasource["type"] == "prometheus"
    assert datasource["url"] == "http://prometheus:9090" and "prometheus" in services
    assert any(p.endswith(":9090") for p in services["prometheus"]["ports"])
    (provider,) = yaml.safe_load((provisioning / "dashboards/xmcserve.yml").read_text())["providers"]
    mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"])
    assert mounts["./deploy/grafana/dashboards"] == provider["options"]["path"]
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    dashboards = list((ROOT / "deploy/grafana/dashboards").glob("*.json"))
    assert dashboards
    for path in dashboards:
        dashboard = json.loads(path.read_text())
        assert dashboard["uid"] and dashboard["title"] and dashboard["panels"]
        for panel in dashboard["panels"]:
            source = panel.get("datasource")
            if isinstance(source, dict):
                assert source.get("uid") in (datasource["uid"], "${datasource}", None), (panel["title"], source)
