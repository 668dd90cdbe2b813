# ruff: noqa: F811 (the fixtures imported from tests/unit/test_compose.py are the tests' arguments)
"""The broker configs docker-compose.yml mounts, read by the real nats-server (`nats-server -t`), and
the compose header's sandbox-password line run in a shell: the parts of test_compose.py's checks
that start a process (tests/unit starts none)."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from pathlib import PurePosixPath

import pytest

from marlaas.platform import nats_access
from marlaas.platform.config import load_config
from marlaas.stack import broker_auth
from marlaas.stack.admin import add_tenant_commands
from marlaas.stack.broker_auth import find_server_binary
from tests.unit.test_compose import (  # noqa: F401 (compose, raw_compose, services: the tests' fixtures)
    COMPOSE_ENV,
    ROOT,
    cluster_conf,
    command_line,
    compose,
    config_content,
    nats_auth_path,
    raw_compose,
    services,
)

pytestmark = pytest.mark.timeout(60)


def test_nats_server_accepts_the_broker_config_with_its_rendered_users(compose, services, tmp_path,
                                                                       monkeypatch):
    from marlaas.stack.admin import cmd_init_auth

    nats = services["nats"]
    words = command_line(nats)
    target = words[words.index("--config") + 1]
    main = tmp_path / "marlaas.conf"
    main.write_text(config_content(compose, nats, target))
    auth = tmp_path / nats_auth_path(compose, services).relative_to(PurePosixPath(target).parent)

    def init_auth(password: str) -> None:
        monkeypatch.setenv("MARLAAS_NATS_PASSWORD", password)
        args = argparse.Namespace(auth_file=str(auth), json=False)
        assert cmd_init_auth(args, load_config(env={"MARLAAS_HOME": str(tmp_path)})) == 0

    def accepted() -> None:
        done = subprocess.run([find_server_binary(), "-c", str(main), "-t"], capture_output=True,
                              text=True, timeout=30)
        assert done.returncode == 0, done.stderr

    init_auth("first")  # the first start: the services user alone
    accepted()
    tenant_hash = nats_access.bcrypt_hash("mlt_acme_" + "0" * 32)
    users = broker_auth.render_auth(nats_access.bcrypt_hash("first"), [("acme", tenant_hash)])
    broker_auth.write_auth_conf(auth, users)
    init_auth("second")  # a new services password keeps the tenants
    text = auth.read_text()
    assert tenant_hash in text and "marlaas.tool.acme.>" in text
    assert broker_auth.with_services_password(text, "second") == text
    accepted()


def test_nats_server_accepts_the_cluster_config(compose, services, tmp_path):


    (tmp_path / "marlaas.conf").write_text(config_content(compose, services["nats"], "/etc/nats/marlaas.conf"))
    main = tmp_path / "cluster.conf"
    main.write_text(cluster_conf(compose, services))
    auth = tmp_path / nats_auth_path(compose, services).relative_to("/etc/nats")
    broker_auth.write_auth_conf(auth, broker_auth.render_auth(nats_access.bcrypt_hash("pw"), []))
    words = command_line(services["nats-1"])
    words[words.index("--config") + 1] = str(main)
    env = {**os.environ, "MARLAAS_NATS_PASSWORD": COMPOSE_ENV["MARLAAS_NATS_PASSWORD"]}
    done = subprocess.run([find_server_binary(), *words, "-t"], capture_output=True, text=True,
                          timeout=30, env=env)
    assert done.returncode == 0, done.stderr


def test_the_header_says_how_to_derive_the_sandbox_password(tmp_path):


    header = (ROOT / "docker-compose.yml").read_text().split("\nname:")[0]
    assert "MARLAAS_SANDBOX_NATS_PASSWORD" in header and "tenant sandbox-password" in header
    parser = argparse.ArgumentParser(prog="marlaas")
    add_tenant_commands(parser.add_subparsers(dest="command", required=True))
    assert parser.parse_args(["tenant", "sandbox-password"]).fn.__name__ == "cmd_sandbox_password"
    [line] = [line.lstrip("# ").split(":", 1)[1] for line in header.splitlines() if "openssl dgst" in line]
    if shutil.which("openssl"):
        done = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=30, check=True,
                              env={"PATH": "/usr/bin:/bin", "MARLAAS_NATS_PASSWORD": "test-password"})
        assert done.stdout.strip() == nats_access.sandbox_password("test-password")
