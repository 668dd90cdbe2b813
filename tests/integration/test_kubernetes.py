# ruff: noqa: F811 (the fixtures imported from tests/unit/test_compose.py are the tests' arguments)
"""deploy/kubernetes/: the overlays render with `kubectl kustomize` (no cluster), every object they
render is valid against Kubernetes' schemas and KEDA's CRD (offline), and the manifests run what
docker-compose.yml and the services' code run: the same images, commands, ports, probes and
environment; the ScaledObjects read the consumers the code consumes, with lagThresholds recomputed
from the measurement they name. kubectl, nats-server and the NATS pods' auth script run as
processes, hence tests/integration; no stack is started."""

from __future__ import annotations

import argparse
import ast
import copy
import functools
import math
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from urllib.parse import urlparse

import jsonschema
import kubernetes_validate
import pytest
import yaml

from marlaas.platform import nats_access
from marlaas.platform.bus import BUCKETS, STREAMS
from marlaas.platform.config import GatewayConfig, load_config
from marlaas.platform.processes import SHUTDOWN_GRACE_S
from marlaas.stack import broker_auth
from marlaas.stack.admin import add_tenant_commands
from marlaas.stack.broker_auth import find_server_binary
from marlaas.tools.registry import TOOLS_BUCKET
from tests.unit.test_compose import (  # noqa: F401 (compose, raw_compose, services: the tests' fixtures)
    VARIABLE,
    command_line,
    compose,
    raw_compose,
    services,
)

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("cpu", "gpu")
KUBERNETES_VERSION = "1.33"  # the oldest the manifests are for: the sandbox's user namespace and /proc
KEDA_CRD = KUBE / "schemas" / "keda-v2.20.2-scaledobjects.yaml"
# the nats-jetstream trigger's metadata in KEDA v2.20.2 (pkg/scalers/nats_jetstream_scaler.go): the
# CRD keeps trigger metadata free-form, so a misspelt key would only fail in the cluster
NATS_TRIGGER_KEYS = {"natsServerMonitoringEndpoint", "account", "accountID", "stream", "consumer",
                     "lagThreshold", "activationLagThreshold", "useHttps"}
SERVICES = ("manager", "rollout", "env", "trainer", "gateway", "sandbox")
WORKERS = ("rollout", "env", "trainer", "sandbox")  # scaled by KEDA
GPU_SERVICES = ("rollout", "trainer")
MEASUREMENT = ROOT / "docs" / "benchmarks" / "agentic-10-chat-results.md"  # the lagThresholds' source


def kubectl() -> str:
    found = shutil.which("kubectl")
    if not found:
        pytest.fail("kubectl is not installed: these tests render deploy/kubernetes with `kubectl kustomize` "
                    "(kustomize is built in; any kubectl >= 1.27, no cluster needed)")
    return found


def render(path: Path) -> list[dict]:
    done = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"kubectl kustomize {path} failed:\n{done.stderr}"
    return [obj for obj in yaml.safe_load_all(done.stdout) if obj]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    """Each overlay's objects, and the cpu overlay with the Ingress example (a kustomization beside
    them that adds the component: kustomize takes relative paths only)."""
    out = {name: render(KUBE / "overlays" / name) for name in OVERLAYS}
    example = tmp_path_factory.mktemp("ingress")
    (example / "kustomization.yaml").write_text(yaml.safe_dump({
        "namespace": "marlaas",  # as an overlay of one's own sets it
        "resources": [os.path.relpath(KUBE / "overlays" / "cpu", example)],
        "components": [os.path.relpath(KUBE / "components" / "ingress", example)],
    }))
    out["cpu+ingress"] = render(example)
    return out


@pytest.fixture(scope="module")
def cpu(rendered) -> list[dict]:
    return rendered["cpu"]


def one(objects: list[dict], kind: str, name: str) -> dict:
    [found] = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def container(objects: list[dict], name: str, kind: str = "Deployment") -> dict:
    [found] = [c for c in one(objects, kind, name)["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return found


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def config_map(objects: list[dict], prefix: str) -> dict:
    """A generated ConfigMap (its name carries kustomize's content hash)."""
    [found] = [o for o in objects if o["kind"] == "ConfigMap" and re.fullmatch(rf"{prefix}-\w+", o["metadata"]["name"])]
    return found


# --- schemas ------------------------------------------------------------------------------------


def strict(schema):
    """A CRD's schema as the API server's strict field validation reads it: a field the schema does
    not list is an error (wherever it lists properties and keeps no unknown fields)."""
    if isinstance(schema, dict):
        if (schema.get("type") == "object" and "properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema = {**schema, "additionalProperties": False}
        return {key: strict(value) for key, value in schema.items()}
    if isinstance(schema, list):
        return [strict(value) for value in schema]
    return schema


@pytest.fixture(scope="module")
def scaled_object_validator():
    crd = yaml.safe_load(KEDA_CRD.read_text())
    assert crd["spec"]["names"]["kind"] == "ScaledObject" and crd["spec"]["group"] == "keda.sh"
    [served] = [v for v in crd["spec"]["versions"] if v["served"] and v["storage"]]
    return served["name"], jsonschema.Draft7Validator(strict(served["schema"]["openAPIV3Schema"]))


def problems(obj: dict, scaled_object_validator) -> list[str]:
    """Why ``obj`` is not valid ([] = it is), against KEDA's CRD or Kubernetes' own schemas."""
    if obj["apiVersion"].split("/")[0] == "keda.sh":
        version, validator = scaled_object_validator
        if obj["apiVersion"] != f"keda.sh/{version}" or obj["kind"] != "ScaledObject":
            return [f"{obj['apiVersion']} {obj['kind']}: no schema kept for it (deploy/kubernetes/schemas)"]
        return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]
    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"]
    except kubernetes_validate.SchemaNotFoundError as e:
        return [e.message]
    return []


@pytest.mark.parametrize("overlay", [*OVERLAYS, "cpu+ingress"])
def test_every_rendered_object_is_valid_against_the_kubernetes_and_keda_schemas(rendered, overlay,
                                                                                 scaled_object_validator):
    objects = rendered[overlay]
    found = {f"{o['kind']}/{o['metadata']['name']}": problems(o, scaled_object_validator) for o in objects}
    assert not {name: errors for name, errors in found.items() if errors}
    kinds = {o["kind"] for o in objects}
    assert {"StatefulSet", "Deployment", "Service", "PodDisruptionBudget", "ScaledObject", "ConfigMap"} <= kinds
    assert ("Ingress" in kinds) == (overlay == "cpu+ingress")
    for o in objects:
        assert o["kind"] == "Namespace" or o["metadata"]["namespace"] == "marlaas", o["metadata"]["name"]


def test_the_validation_refuses_a_misspelt_field(cpu, scaled_object_validator):
    """Strict: an unknown field fails, as it would with `kubectl apply --validate=strict`."""
    deployment = copy.deepcopy(one(cpu, "Deployment", "rollout"))
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    scaled = copy.deepcopy(one(cpu, "ScaledObject", "rollout"))
    scaled["spec"]["minReplicas"] = 0
    assert problems(deployment, scaled_object_validator) and problems(scaled, scaled_object_validator)
    assert not problems(one(cpu, "ScaledObject", "rollout"), scaled_object_validator)


# --- the consumers KEDA reads ---------------------------------------------------------------------


def module_constants(tree: ast.Module) -> dict[str, object]:
    return {target.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant) for target in node.targets if isinstance(target, ast.Name)}


def consumers(service: str) -> dict[str, set]:
    """What a service's code reads from JetStream: ``fixed``, the (stream, durable) of each
    ``bus.consume(...)``; ``per_tenant``, the stream of each ``TenantQueues(...)`` (consumers named
    ``<durable>-<tenant>``, one per tenant); ``fifo_when_no_fair_share``, the fixed ones consumed only
    in the ``else`` of an ``if ...fair_share:``."""
    found = {"fixed": set(), "per_tenant": set(), "fifo_when_no_fair_share": set()}
    for path in sorted((ROOT / "services" / service).rglob("*.py")):
        tree = ast.parse(path.read_text())
        constants = module_constants(tree)

        def value(node, constants=constants):
            return node.value if isinstance(node, ast.Constant) else constants.get(getattr(node, "id", None))

        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "consume":
                found["fixed"].add((value(node.args[0]), value(node.args[1])))
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "TenantQueues":
                found["per_tenant"].add(value(node.args[1]))
            if (isinstance(node, ast.If) and isinstance(node.test, ast.Attribute) and node.test.attr == "fair_share"):
                for call in (n for branch in node.orelse for n in ast.walk(branch)):
                    if isinstance(call, ast.Call) and getattr(call.func, "attr", None) == "consume":
                        found["fifo_when_no_fair_share"].add((value(call.args[0]), value(call.args[1])))
    return found


def trigger(objects: list[dict], name: str) -> dict:
    [only] = one(objects, "ScaledObject", name)["spec"]["triggers"]
    assert only["type"] == "nats-jetstream"
    return only["metadata"]


def k8s_config(objects: list[dict]):
    return tomllib.loads(config_map(objects, "marlaas-config")["data"]["marlaas.toml"])


def test_each_scaled_object_reads_the_consumer_its_service_takes_work_from(rendered):
    rollout, trainer = consumers("rollout"), consumers("trainer")
    [rollout_fixed] = rollout["fixed"]  # announcements: one consumer for every tenant
    assert rollout_fixed == ("POLICY", "rollout")
    # the trainer's one FIFO consumer exists only with trainer.fair_share off, as the manifests set it:
    # with it on, each tenant's queue is a consumer of its own, which no ScaledObject can name
    [trainer_fifo] = trainer["fifo_when_no_fair_share"]
    assert trainer_fifo in trainer["fixed"] and trainer_fifo[0] in trainer["per_tenant"]
    # env and the sandbox read no stream: they answer requests that rollout's episodes make
    for service in ("env", "sandbox"):
        assert consumers(service) == {"fixed": set(), "per_tenant": set(), "fifo_when_no_fair_share": set()}
    expected = {"rollout": rollout_fixed, "trainer": trainer_fifo, "env": rollout_fixed, "sandbox": rollout_fixed}
    streams = {spec.name for spec in STREAMS}
    for overlay in OVERLAYS:
        objects = rendered[overlay]
        assert k8s_config(objects)["trainer"]["fair_share"] is False
        nats = one(objects, "StatefulSet", "nats")
        headless = one(objects, "Service", nats["spec"]["serviceName"])
        monitor = {p["name"]: p["port"] for p in headless["spec"]["ports"]}["monitor"]
        endpoint = f"{headless['metadata']['name']}.{headless['metadata']['namespace']}.svc.cluster.local:{monitor}"
        scaled = {o["spec"]["scaleTargetRef"]["name"] for o in objects if o["kind"] == "ScaledObject"}
        assert scaled == set(WORKERS)  # never the manager, the gateway or NATS
        for service, (stream, durable) in expected.items():
            meta = trigger(objects, service)
            assert set(meta) <= NATS_TRIGGER_KEYS, service
            assert (meta["stream"], meta["consumer"]) == (stream, durable), service
            assert stream in streams
            assert meta["account"] == nats_access.PLATFORM_ACCOUNT
            assert meta["natsServerMonitoringEndpoint"] == endpoint


def test_replica_bounds_and_why_no_worker_sleeps(rendered):
    """Every worker keeps one replica: rollout and trainer serve the Tinker API's per-tenant queues,
    which no trigger reads; env (the registrar) and the sandbox keep tools' registry entries alive,
    which expire a TTL after their last heartbeat, so asleep they would refuse the jobs that would
    wake them. If the registry stops expiring entries, env and sandbox may sleep (minReplicaCount 0)."""
    [tools] = [b for b in BUCKETS if b.name == TOOLS_BUCKET]
    assert tools.ttl_s > 0
    for overlay in OVERLAYS:
        for service in WORKERS:
            spec = one(rendered[overlay], "ScaledObject", service)["spec"]
            assert spec["minReplicaCount"] == 1 and spec["maxReplicaCount"] > 1, (overlay, service)
            assert "replicas" not in one(rendered[overlay], "Deployment", service)["spec"]  # KEDA's to set
    gpu = {s: one(rendered["gpu"], "ScaledObject", s)["spec"]["maxReplicaCount"] for s in GPU_SERVICES}
    assert gpu == {"rollout": 4, "trainer": 2}
    assert one(rendered["cpu"], "Deployment", "manager")["spec"]["replicas"] == 1
    assert one(rendered["cpu"], "Deployment", "manager")["spec"]["strategy"]["type"] == "Recreate"  # one writer


def markdown_tables(text: str) -> list[list[dict[str, str]]]:
    tables, rows = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
        elif rows:
            header, _, *body = rows
            tables.append([dict(zip(header, row)) for row in body])
            rows = []
    return tables


def async_row(tables: list[list[dict[str, str]]], column: str) -> dict[str, str]:
    [row] = [row for table in tables for row in table if column in row and row.get("mode") == "async"]
    return row


def test_lag_thresholds_follow_from_the_measured_throughput(cpu):
    """docs/kubernetes.md derives each lagThreshold from one run (MEASUREMENT, async): X versions/s
    from steps/h, W the time an announcement is in rollout's hands (handoff + generate + reward)."""
    tables = markdown_tables(MEASUREMENT.read_text())
    summary, phases = async_row(tables, "steps/h"), async_row(tables, "generate")
    cpu_s = async_row(tables, "rollout engine")  # CPU seconds a version, each service
    x = float(summary["steps/h"]) / 3600
    w = sum(float(phases[p]) for p in ("handoff", "generate", "reward")) / 1000
    percent = {k: float(summary[k].rstrip("%")) / 100 for k in ("engine busy", "trainer busy")}
    expected = {
        "rollout": math.floor(x / percent["engine busy"] * w),  # Little's law at a replica's full rate
        "trainer": math.floor(x / percent["trainer busy"] * w),  # a trainer's queue cleared within W
        "env": math.floor(w / float(cpu_s["env"])),  # an env replica's core, in announcements held
    }
    expected["sandbox"] = expected["rollout"]  # not measured: one per rollout replica's worth
    assert expected == {"rollout": 8, "trainer": 21, "env": 162, "sandbox": 8}  # as written beside them
    assert {s: int(trigger(cpu, s)["lagThreshold"]) for s in WORKERS} == expected
    for text in ((KUBE / "base" / "autoscaling" / "scaledobjects.yaml").read_text(),
                 (ROOT / "docs" / "kubernetes.md").read_text()):
        assert MEASUREMENT.name in text and summary["steps/h"] in text


# --- what compose and the services run ------------------------------------------------------------


def compose_twin(services: dict, name: str) -> dict:
    """The compose service a Deployment stands for: its `ha` twin, on the three-node cluster."""
    return services[f"{name}-ha"]


def passwords_in_url(raw_compose: dict, name: str) -> set[str]:
    """The variables compose puts into the service's broker URL (its password's)."""
    url = raw_compose["services"][f"{name}-ha"]["environment"]["MARLAAS_NATS_URL"]
    return {found["name"] for found in VARIABLE.finditer(url) if found["name"]}


@functools.cache
def code_text() -> str:
    return "".join(path.read_text() for path in [*(ROOT / "libs").rglob("*.py"), *(ROOT / "services").rglob("*.py")])


def code_reads(variable: str) -> bool:
    return re.search(rf"\b{variable}\b", code_text()) is not None


def test_each_service_runs_the_image_and_command_compose_runs(rendered, services):
    for overlay in OVERLAYS:
        for name in SERVICES:
            c = container(rendered[overlay], name)
            twin = compose_twin(services, name)
            image = "marlaas-gpu:latest" if overlay == "gpu" and name in GPU_SERVICES else twin["image"]
            assert c["image"] == image, (overlay, name)
            assert [*c["command"], *c["args"]] == command_line(twin), name
            config = command_line(twin)[command_line(twin).index("--config") + 1]
            [mount] = [m for m in c["volumeMounts"] if m["mountPath"] == config]
            assert any(v.startswith(f"./deploy/marlaas.toml:{config}") for v in twin["volumes"])
            assert mount["subPath"] == "marlaas.toml" and mount["readOnly"]
    nats, minio = one(rendered["cpu"], "StatefulSet", "nats"), one(rendered["cpu"], "StatefulSet", "minio")
    assert container(rendered["cpu"], "nats", "StatefulSet")["image"] == services["nats"]["image"]
    init_images = {c["image"] for c in nats["spec"]["template"]["spec"]["initContainers"]}
    assert init_images == {services["nats-auth-init"]["image"]}
    assert container(rendered["cpu"], "minio", "StatefulSet")["image"] == services["minio"]["image"]
    assert container(rendered["cpu"], "minio", "StatefulSet")["args"] == services["minio"]["command"]
    assert minio["spec"]["replicas"] == 1


def test_each_service_has_the_environment_compose_gives_it(rendered, services, raw_compose):
    """The same MARLAAS_* names as compose's `ha` twin, plus the password compose interpolates into
    the broker URL (the Kubernetes way: an earlier variable, `$(NAME)` in the URL); literal values
    equal compose's; every secret from a Secret; the sandbox holds no platform secret."""
    for overlay in OVERLAYS:
        for name in SERVICES:
            c = container(rendered[overlay], name)
            env, twin = env_of(c), compose_twin(services, name)["environment"]
            extra = {"MARLAAS_DEVICE"} if overlay == "gpu" and name == "trainer" else set()
            assert set(env) == set(twin) | passwords_in_url(raw_compose, name) | extra, (overlay, name)
            for var, entry in env.items():
                assert code_reads(var) or var in passwords_in_url(raw_compose, name), var
                defined_before = list(env)[:list(env).index(var)]
                assert set(re.findall(r"\$\((\w+)\)", entry.get("value", ""))) <= set(defined_before), var
                if "value" in entry and var not in ("MARLAAS_NATS_URL", "MARLAAS_DEVICE"):
                    assert entry["value"] == twin[var], (name, var)
                elif var != "MARLAAS_NATS_URL" and var not in extra:
                    assert set(entry["valueFrom"]) == {"secretKeyRef"}, (name, var)
    sandbox = env_of(container(rendered["cpu"], "sandbox"))
    secrets = {(e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
               for e in sandbox.values() if "valueFrom" in e}
    assert secrets == {("marlaas-nats", "sandbox-password")}  # not the services', no S3 key
    assert env_of(container(rendered["gpu"], "trainer"))["MARLAAS_DEVICE"]["value"] == "cuda"


def test_the_broker_urls_name_every_node_of_the_cluster(rendered):
    nats = one(rendered["cpu"], "StatefulSet", "nats")
    client = {p["name"]: p["containerPort"] for p in container(rendered["cpu"], "nats", "StatefulSet")["ports"]}
    nodes = [f"nats-{i}.{nats['spec']['serviceName']}" for i in range(nats["spec"]["replicas"])]
    for name in SERVICES:
        env = env_of(container(rendered["cpu"], name))
        urls = [urlparse(url) for url in env["MARLAAS_NATS_URL"]["value"].split(",")]
        user = nats_access.SANDBOX_USER if name == "sandbox" else nats_access.SERVICES_USER
        assert [u.hostname for u in urls] == nodes and {u.port for u in urls} == {client["client"]}
        assert {(u.scheme, u.username) for u in urls} == {("nats", user)}
        [password] = {u.password for u in urls}
        assert re.fullmatch(r"\$\(\w+\)", password), name
        if name != "sandbox":
            assert env["MARLAAS_NATS_REPLICAS"]["value"] == str(nats["spec"]["replicas"])


def ready_file_name(service: str) -> str:
    """The name the service passes to run_service, which names its ready file."""
    tree = ast.parse((ROOT / "services" / service / "__main__.py").read_text())
    [name] = [call.args[0].value for call in ast.walk(tree) if isinstance(call, ast.Call)
              and getattr(call.func, "id", None) == "run_service"]
    return name


def gateway_routes() -> set[str]:
    tree = ast.parse((ROOT / "services" / "gateway" / "operations.py").read_text())
    return {d.args[0].value for node in ast.walk(tree) if isinstance(node, ast.AsyncFunctionDef)
            for d in node.decorator_list if isinstance(d, ast.Call) and getattr(d.func, "id", None) == "get"
            and d.args and isinstance(d.args[0], ast.Constant)}


def test_probes_and_ports_are_the_services_own(cpu, services):
    config = load_config(KUBE / "base" / "marlaas.toml", env={})
    for name in SERVICES:
        c = container(cpu, name)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert probe in c, (name, probe)
        if name == "gateway":
            port = GatewayConfig().port
            assert c["ports"] == [{"name": "http", "containerPort": port}]
            assert services["gateway-ha"]["ports"] == [f"127.0.0.1:{port}:{port}"]
            assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
            assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
            assert {"/readyz", "/healthz"} <= gateway_routes()
            service = one(cpu, "Service", "gateway")
            assert service["spec"]["ports"][0]["targetPort"] == "http"
            continue
        home = env_of(c).get("MARLAAS_HOME", {}).get("value", config.home)
        ready = f"{home}/run/ready/{ready_file_name(name)}-*"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["exec"]["command"] == ["sh", "-c", f"ls {ready} >/dev/null 2>&1"], (name, probe)
    nats = container(cpu, "nats", "StatefulSet")
    ports = {p["name"]: p["containerPort"] for p in nats["ports"]}
    conf = (KUBE / "base" / "nats" / "marlaas.conf").read_text() + (KUBE / "base" / "nats" / "cluster.conf").read_text()
    assert ports == {"client": int(re.search(r"^listen: \S+:(\d+)", conf, re.M)[1]),
                     "monitor": int(re.search(r"^http: \S+:(\d+)", conf, re.M)[1]),
                     "cluster": int(re.search(r"^  listen: \S+:(\d+)", conf, re.M)[1])}
    assert {ports["client"], ports["monitor"]} <= {int(p) for p in services["nats"]["expose"]}
    assert nats["readinessProbe"]["httpGet"]["port"] == "monitor"
    minio = container(cpu, "minio", "StatefulSet")
    words = services["minio"]["command"]
    assert {p["containerPort"] for p in minio["ports"]} == {int(words[words.index(flag) + 1].lstrip(":"))
                                                           for flag in ("--address", "--console-address")}
    assert minio["readinessProbe"]["httpGet"]["path"] == "/minio/health/ready"


def test_rollout_and_trainer_get_a_gpu_only_in_the_gpu_overlay(rendered):
    for overlay in OVERLAYS:
        for name in SERVICES:
            limits = container(rendered[overlay], name)["resources"]["limits"]
            assert ("nvidia.com/gpu" in limits) == (overlay == "gpu" and name in GPU_SERVICES), (overlay, name)
            assert "memory" in limits and "memory" in container(rendered[overlay], name)["resources"]["requests"]
    shm = [v for v in one(rendered["cpu"], "Deployment", "rollout")["spec"]["template"]["spec"]["volumes"]
           if v["name"] == "shm"]
    assert shm == [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}}]  # compose's shm_size


def test_the_sandbox_gets_what_compose_grants_bubblewrap_and_nothing_more(cpu, services):
    c = container(cpu, "sandbox")
    granted = c["securityContext"]
    assert granted["capabilities"] == {"drop": ["ALL"], "add": services["sandbox"]["cap_add"]}
    assert services["sandbox"]["cap_drop"] == ["ALL"] and services["sandbox"]["user"] == "0"
    assert granted["runAsUser"] == 0 and granted["procMount"] == "Unmasked"  # compose: systempaths=unconfined
    lifted = {"seccomp=unconfined", "apparmor=unconfined", "systempaths=unconfined"}
    assert set(services["sandbox"]["security_opt"]) == lifted
    assert granted["seccompProfile"] == {"type": "Unconfined"} and granted["appArmorProfile"] == {"type": "Unconfined"}
    assert one(cpu, "Deployment", "sandbox")["spec"]["template"]["spec"]["hostUsers"] is False
    for name in set(SERVICES) - {"sandbox"}:
        other = container(cpu, name)["securityContext"]
        assert other["runAsNonRoot"] and other["capabilities"] == {"drop": ["ALL"]}, name


def test_termination_grace_covers_each_drain(cpu):
    for name in SERVICES:
        pod = one(cpu, "Deployment", name)["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] > SHUTDOWN_GRACE_S, name
    conf = (KUBE / "base" / "nats" / "cluster.conf").read_text()
    lame_duck = sum(int(re.search(rf'^{key}: "(\d+)s"', conf, re.M)[1])
                    for key in ("lame_duck_duration", "lame_duck_grace_period"))
    nats = one(cpu, "StatefulSet", "nats")["spec"]["template"]["spec"]
    assert nats["terminationGracePeriodSeconds"] > lame_duck
    [prestop] = [c["lifecycle"]["preStop"]["exec"]["command"] for c in nats["containers"] if c["name"] == "nats"]
    assert prestop[1:] == ["--signal", "ldm=/var/run/nats/nats.pid"]


def test_disruption_budgets(cpu):
    budgets = {o["metadata"]["name"]: o["spec"] for o in cpu if o["kind"] == "PodDisruptionBudget"}
    assert budgets["nats"] == {"maxUnavailable": 1, "selector": {"matchLabels": {"app.kubernetes.io/name": "nats"}}}
    assert budgets["gateway"]["minAvailable"] == 1 and one(cpu, "Deployment", "gateway")["spec"]["replicas"] == 2
    for name in WORKERS:
        assert budgets[name]["maxUnavailable"] == 1
    # the manager and MinIO are single: a budget would only block a node's drain
    assert set(budgets) == {"nats", "gateway", *WORKERS}


# --- NATS: the project's broker config and users ------------------------------------------------


def test_nats_runs_composes_broker_config_and_cluster_block(cpu):
    ours = config_map(cpu, "nats-config")["data"]
    assert ours["marlaas.conf"] == (ROOT / "deploy" / "nats" / "marlaas.conf").read_text()
    theirs = (ROOT / "deploy" / "nats" / "cluster.conf").read_text()
    block = re.search(r"^cluster \{$.*?^\}$", theirs, re.M | re.S)[0]
    assert block in ours["cluster.conf"] and re.search(r'^include "marlaas.conf"', ours["cluster.conf"], re.M)


def nats_args(cpu, directory: Path, password: str) -> list[str]:
    """The StatefulSet's nats-server command line for pod nats-0, its files under ``directory``."""
    words = container(cpu, "nats", "StatefulSet")["args"]
    words = [w.replace("$(POD_NAME)", "nats-0").replace("$(MARLAAS_NATS_PASSWORD)", password) for w in words]
    words[words.index("--config") + 1] = str(directory / "cluster.conf")
    words[words.index("--pid") + 1] = str(directory / "nats.pid")
    return words


def test_nats_server_accepts_the_pods_config_and_users(cpu, tmp_path):
    for name, text in config_map(cpu, "nats-config")["data"].items():
        (tmp_path / name).write_text(text)
    auth = tmp_path / "auth" / broker_auth.AUTH_FILE
    tenant = ("acme", nats_access.bcrypt_hash("mlt_acme_" + "0" * 32))
    broker_auth.write_auth_conf(auth, broker_auth.render_auth("pw", [tenant]))
    words = nats_args(cpu, tmp_path, "pw")
    routes = words[words.index("--routes") + 1].split(",")
    assert [urlparse(r).hostname for r in routes] == [f"nats-{i}.nats-headless" for i in range(3)]
    assert {urlparse(r).username for r in routes} == {"route"}  # cluster.conf's route user
    done = subprocess.run([find_server_binary(), *words, "-t"], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "MARLAAS_NATS_PASSWORD": "pw"})
    assert done.returncode == 0, done.stderr


def auth_script_env(tmp_path: Path, password: str) -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)  # marlaas and nats-server, as in the image
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "MARLAAS_NATS_PASSWORD": password,
            "NATS_AUTH_SECRET": str(tmp_path / "secret" / "auth.conf"),
            "NATS_AUTH_FILE": str(tmp_path / "auth" / "auth.conf"), "NATS_PID_FILE": str(tmp_path / "nats.pid"),
            "NATS_AUTH_EVERY_S": "0.2", "NATS_RELOAD_GAP_S": "0.3"}


def test_the_pods_auth_script_keeps_the_tenants_and_takes_the_services_password(cpu, tmp_path):
    script = config_map(cpu, "nats-auth-script")["data"]["nats-auth.sh"]
    (tmp_path / "nats-auth.sh").write_text(script)
    (tmp_path / "auth").mkdir()
    (tmp_path / "secret").mkdir()
    env = auth_script_env(tmp_path, "second")

    def init() -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(tmp_path / "nats-auth.sh"), "init"], env=env, capture_output=True,
                              text=True, timeout=60)

    assert init().returncode == 0  # no Secret yet: the services and sandbox users alone
    auth = Path(env["NATS_AUTH_FILE"])
    assert broker_auth.with_services_password(auth.read_text(), "second") == auth.read_text()
    assert "acme" not in auth.read_text()
    tenant = ("acme", nats_access.bcrypt_hash("mlt_acme_" + "0" * 32))
    Path(env["NATS_AUTH_SECRET"]).write_text(broker_auth.render_auth("first", [tenant]))  # an older password
    assert init().returncode == 0
    text = auth.read_text()
    assert tenant[1] in text and broker_auth.with_services_password(text, "second") == text
    Path(env["NATS_AUTH_SECRET"]).write_text(text.replace("accounts {", "accounts {{", 1))
    refused = init()
    assert refused.returncode != 0 and "refuses" in refused.stderr and auth.read_text() == text


def test_the_pods_auth_watcher_reloads_nats_twice_when_the_secret_changes(cpu, tmp_path):
    (tmp_path / "nats-auth.sh").write_text(config_map(cpu, "nats-auth-script")["data"]["nats-auth.sh"])
    (tmp_path / "auth").mkdir()
    (tmp_path / "secret").mkdir()
    env = auth_script_env(tmp_path, "pw")
    subprocess.run(["bash", str(tmp_path / "nats-auth.sh"), "init"], env=env, check=True, capture_output=True,
                   timeout=60)
    conf = tmp_path / "server.conf"  # a free port of its own; the users as in the pod
    conf.write_text(f'listen: 127.0.0.1:-1\njetstream {{ store_dir: "{tmp_path / "js"}" }}\ninclude "auth/auth.conf"\n')
    log = tmp_path / "nats.log"
    server = subprocess.Popen([find_server_binary(), "-c", str(conf), "-P", env["NATS_PID_FILE"], "-l", str(log)])
    watcher = subprocess.Popen(["bash", str(tmp_path / "nats-auth.sh"), "watch"], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while not Path(env["NATS_PID_FILE"]).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        tenant = ("acme", nats_access.bcrypt_hash("mlt_acme_" + "0" * 32))
        Path(env["NATS_AUTH_SECRET"]).write_text(broker_auth.render_auth("pw", [tenant]))  # tenant.sh's part
        while log.read_text().count("Reloaded server configuration") < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert log.read_text().count("Reloaded server configuration") == 2
        assert tenant[1] in Path(env["NATS_AUTH_FILE"]).read_text()
    finally:
        watcher.terminate()
        server.terminate()
        watcher.wait(timeout=10)
        server.wait(timeout=10)


def test_tenant_sh_runs_marlaas_tenant_where_the_pods_read_its_users(cpu):
    text = (KUBE / "tenant.sh").read_text()
    secret = re.search(r"create secret generic (\S+) --from-file=auth.conf=", text)[1]
    nats = one(cpu, "StatefulSet", "nats")["spec"]["template"]["spec"]
    [volume] = [v for v in nats["volumes"] if v["name"] == "auth-secret"]
    assert volume["secret"]["secretName"] == secret
    target = re.search(r"exec deploy/(\w+) -- marlaas tenant", text)[1]
    assert "MARLAAS_NATS_URL" in env_of(container(cpu, target))
    parser = argparse.ArgumentParser(prog="marlaas")
    add_tenant_commands(parser.add_subparsers(dest="command", required=True))
    for action in ("add", "revoke", "sync"):
        words = ["tenant", action, *(["acme"] if action != "sync" else []), "--auth-file", "/tmp/auth.conf"]
        assert parser.parse_args(words).auth_file == "/tmp/auth.conf"
        assert f"{action} |" in text or f"| {action}" in text


# --- config and Secrets -------------------------------------------------------------------------


def flat(tree: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for key, value in tree.items():
        out.update(flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def test_the_services_config_is_composes_but_for_the_trainers_fair_share(cpu, tmp_path):
    ours = config_map(cpu, "marlaas-config")["data"]["marlaas.toml"]
    theirs = tomllib.loads((ROOT / "deploy" / "marlaas.toml").read_text())
    different = {k for k in flat(tomllib.loads(ours)).keys() | flat(theirs).keys()
                 if flat(tomllib.loads(ours)).get(k) != flat(theirs).get(k)}
    assert different == {"trainer.fair_share"}
    (tmp_path / "marlaas.toml").write_text(ours)
    assert load_config(tmp_path / "marlaas.toml", env={}).trainer.fair_share is False


def test_every_secret_the_manifests_read_is_one_the_docs_create(rendered):
    docs = (ROOT / "docs" / "kubernetes.md").read_text().replace("\\\n", " ")
    created = {}
    for name, rest in re.findall(r"create secret generic (\S+)([^\n]*)", docs):
        created.setdefault(name, set()).update(re.findall(r"--from-(?:literal|file)=([\w.-]+)=", rest))
    for overlay in OVERLAYS:
        used = set()
        for obj in rendered[overlay]:
            spec = obj.get("spec", {}).get("template", {}).get("spec", {})
            for c in [*spec.get("containers", []), *spec.get("initContainers", [])]:
                used |= {(e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
                         for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})}
            used |= {(v["secret"]["secretName"], "auth.conf") for v in spec.get("volumes", []) if "secret" in v}
        missing = {(name, key) for name, key in used if key not in created.get(name, set())}
        assert not missing, f"docs/kubernetes.md creates no such Secret key: {missing}"


def test_the_docs_derive_the_sandbox_password_as_the_broker_does():
    if not shutil.which("openssl"):
        pytest.fail("openssl is not installed: docs/kubernetes.md derives the sandbox's password with it")
    docs = (ROOT / "docs" / "kubernetes.md").read_text()
    [line] = re.findall(r'--from-literal=sandbox-password="\$\((.*)\)"', docs)
    done = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=30, check=True,
                          env={"PATH": "/usr/bin:/bin", "MARLAAS_NATS_PASSWORD": "test-password"})
    assert done.stdout.strip() == nats_access.sandbox_password("test-password")


def test_the_clients_service_carries_no_monitoring_port(cpu):
    """Tenants reach NATS through ``svc/nats``: it carries the client port alone, since the
    monitoring endpoint names every tenant's connections and consumers; KEDA reads it on the
    headless Service, inside the cluster."""
    assert [p["name"] for p in one(cpu, "Service", "nats")["spec"]["ports"]] == ["client"]
    assert "monitor" in {p["name"] for p in one(cpu, "Service", "nats-headless")["spec"]["ports"]}
