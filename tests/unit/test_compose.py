"""docker-compose.yml and the Dockerfile are consistent (no Docker engine runs here to try them)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from marlaas.config import load_config

ROOT = Path(__file__).resolve().parents[2]
MARLAAS_SERVICES = ("manager", "rollout", "env", "trainer")
WORKERS = ("rollout", "env", "trainer")  # scaled with replicas


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


def command_line(service: dict) -> list[str]:
    """What the container runs: entrypoint then command, each a list or a string."""
    words = []
    for part in (service.get("entrypoint"), service.get("command")):
        words += part.split() if isinstance(part, str) else list(part or [])
    return words


def exposed_ports(service: dict) -> set[int]:
    ports = {int(p) for p in service.get("expose", [])}
    ports |= {int(str(p).rsplit(":", 1)[-1]) for p in service.get("ports", [])}
    return ports


def host_and_port(value: str) -> tuple[str, int | None]:
    parsed = urlparse(value if "://" in value else f"//{value}")
    return parsed.hostname or "", parsed.port


def config_content(compose: dict, service: dict, target: str) -> str:
    [source] = [c["source"] for c in service.get("configs", []) if c["target"] == target]
    return compose["configs"][source]["content"]


def test_every_service_has_an_image_or_build(services):
    for name, service in services.items():
        assert "image" in service or "build" in service, name


def test_one_container_per_marlaas_service_running_its_package(services):
    for name in MARLAAS_SERVICES:
        words = command_line(services[name])
        assert words[:3] == ["python", "-m", f"services.{name}"], (name, words)
        assert (ROOT / "services" / name / "__init__.py").is_file()
        assert (ROOT / "services" / name / "__main__.py").is_file()
        assert services[name]["build"] == "."


def test_every_module_command_names_an_existing_package(services):
    for name, service in services.items():
        words = command_line(service)
        if "-m" in words:
            module = words[words.index("-m") + 1]
            assert (ROOT / module.replace(".", "/")).is_dir(), (name, module)


def test_service_config_file_is_a_valid_marlaas_config(compose, services, tmp_path):
    for name in MARLAAS_SERVICES:
        words = command_line(services[name])
        target = words[words.index("--config") + 1]
        toml = tmp_path / f"{name}.toml"
        toml.write_text(config_content(compose, services[name], target))
        config = load_config(toml, env=services[name]["environment"])
        assert config.nats_url and config.store_url.startswith("s3://"), name


def test_depends_on_targets_exist(services):
    for name, service in services.items():
        for target in service.get("depends_on", {}):
            assert target in services, f"{name} depends on undefined service {target}"
            assert target != name


def dependencies(services: dict, name: str) -> set[str]:
    """Every service ``name`` waits for, directly or through others."""
    found: set[str] = set()
    todo = list(services[name].get("depends_on", {}))
    while todo:
        target = todo.pop()
        if target not in found:
            found.add(target)
            todo += list(services[target].get("depends_on", {}))
    return found


def test_env_vars_point_at_defined_hosts_and_ports(services):
    for name, service in services.items():
        for var, value in service.get("environment", {}).items():
            if not re.match(r"(MARLAAS_NATS_URL|MARLAAS_S3_ENDPOINT|MINIO_URL)$", var):
                continue
            host, port = host_and_port(value)
            assert host in services, f"{name}: {var}={value} names no service"
            assert port in exposed_ports(services[host]), f"{name}: {var}={value}: port not exposed"
            assert host in dependencies(services, name), f"{name} uses {host} without waiting"


def test_nats_and_minio_are_what_the_env_says(services):
    nats_host, _ = host_and_port(services["manager"]["environment"]["MARLAAS_NATS_URL"])
    s3_host, _ = host_and_port(services["manager"]["environment"]["MARLAAS_S3_ENDPOINT"])
    assert services[nats_host]["image"].startswith("nats:2.12")
    assert services[s3_host]["image"].startswith("minio/minio")


def test_store_services_depend_on_the_bucket_being_created(services):
    init = services["minio-init"]
    bucket = urlparse(services["manager"]["environment"]["MARLAAS_STORE_URL"]).netloc
    assert init["environment"]["MINIO_BUCKET"] == bucket
    assert "mc mb" in " ".join(command_line(init))
    for name, service in services.items():
        if "MARLAAS_STORE_URL" in service.get("environment", {}):
            assert service["depends_on"]["minio-init"]["condition"] == (
                "service_completed_successfully"
            ), name


def test_s3_credentials_match_minio_root_user(services):
    minio = services["minio"]["environment"]
    for name, service in services.items():
        env = service.get("environment", {})
        if "MARLAAS_S3_ACCESS_KEY" in env:
            assert env["MARLAAS_S3_ACCESS_KEY"] == minio["MINIO_ROOT_USER"], name
            assert env["MARLAAS_S3_SECRET_KEY"] == minio["MINIO_ROOT_PASSWORD"], name


def test_nats_jetstream_syncs_every_write_to_its_volume(compose, services):
    nats = services["nats"]
    words = command_line(nats)
    conf = config_content(compose, nats, words[words.index("--config") + 1])
    assert re.search(r"jetstream\s*\{[^}]*sync_interval:\s*always", conf)
    store_dir = re.search(r"store_dir:\s*(\S+)", conf).group(1)
    mounts = dict(reversed(v.split(":")[:2]) for v in nats["volumes"])
    assert store_dir in mounts and mounts[store_dir] in compose["volumes"]
    listen_port = int(re.search(r"listen:\s*\S+:(\d+)", conf).group(1))
    assert listen_port in exposed_ports(nats)


def test_named_volumes_and_configs_are_declared(compose, services):
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if not source.startswith((".", "/", "~")):
                assert source in compose.get("volumes", {}), f"{name}: volume {source} undeclared"
        for config in service.get("configs", []):
            assert config["source"] in compose.get("configs", {}), name


def test_workers_can_be_scaled(services):
    for name in WORKERS:
        service = services[name]
        assert service["deploy"]["replicas"] >= 1, name
        assert "container_name" not in service, f"{name}: a fixed name forbids replicas"
        assert "ports" not in service, f"{name}: a host port forbids replicas"


def test_dockerfile_installs_the_project():
    dockerfile = (ROOT / "Dockerfile").read_text()
    steps = re.sub(r"\\\n", " ", dockerfile)  # join continued lines
    assert re.search(r"^FROM python:3\.11-slim\b", steps, re.M)
    for source in ("pyproject.toml", "libs", "services"):
        assert re.search(rf"^COPY .*\b{source}\b", steps, re.M), source
    assert re.search(r"^RUN .*pip install \"?\.\[cpu\]\"?", steps, re.M)
    assert re.search(r"pip uninstall -y torchvision torchaudio torchcodec", steps)
    assert re.search(r'^ENTRYPOINT \["marlaas"\]', steps, re.M)
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert "marlaas" in scripts


def test_docker_build_context_leaves_out_the_venv():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv/" in ignored and ".git/" in ignored
