"""What the embedded stack writes on disk is its owner's only: the services' logs, the secrets
under ``run/`` (the operator's token among them) and the file store (every tenant's adapters)
are not readable by other users of the machine."""

from __future__ import annotations

import stat
import subprocess
import sys

import pytest

from marlaas.platform.config import load_config
from marlaas.platform.store import FileStore
from marlaas.stack import launcher
from marlaas.stack.launcher import Stack
from services.gateway.service import operator_token

pytestmark = pytest.mark.own_stack("the launcher's own run files and logs, and their modes")


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_file_store_creates_its_folders_0700_and_its_files_0600(tmp_path):
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared").chmod(0o755)
    store = FileStore(tmp_path / "shared" / "home" / "store")  # <home> does not exist yet: the store makes it
    store.put_bytes("adapters/acme.job-1/v1/adapter.safetensors", b"weights")
    store.get_file("adapters/acme.job-1/v1/adapter.safetensors", tmp_path / "copy" / "deep" / "adapter")
    job = store.root / "adapters" / "acme.job-1"
    for folder in (tmp_path / "shared" / "home", store.root, job.parent, job, job / "v1", tmp_path / "copy",
                   tmp_path / "copy" / "deep"):
        assert mode(folder) == 0o700, folder
    for file in (store.path("adapters/acme.job-1/v1/adapter.safetensors"), tmp_path / "copy" / "deep" / "adapter"):
        assert mode(file) == 0o600, file
    assert mode(tmp_path / "shared") == 0o755  # a folder that existed keeps its mode


def test_the_launcher_keeps_logs_and_run_files_private(tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / "logs").mkdir(parents=True, mode=0o755)  # as an older version left them
    (home / "logs" / "manager.log").write_text("an older run\n")
    (home / "logs" / "manager.log").chmod(0o644)

    def quick_child(argv, **kwargs):  # a service's place, without starting one
        return subprocess.Popen([sys.executable, "-c", "print('started')"], **kwargs)

    monkeypatch.setattr(launcher, "spawn", quick_child)
    stack = Stack(load_config(env={"MARLAAS_HOME": str(home)}), services=()).start()
    try:
        for name in ("manager", "gateway"):
            stack._spawn(name)
        for proc in stack.procs.values():
            proc.wait(timeout=30)
        for folder in (home / "logs", home / "run", home / "run" / "ready"):
            assert mode(folder) == 0o700, folder
        for name in ("manager", "gateway"):
            log = home / "logs" / f"{name}.log"
            assert mode(log) == 0o600 and log.read_text().endswith("started\n"), log
        assert (home / "logs" / "manager.log").read_text().startswith("an older run\n")  # appended to
        for secret in ("services.password", "nats.url", "config.json", "default-tenant.token", "operator.token"):
            assert mode(home / "run" / secret) == 0o600, secret
        assert operator_token(stack.config) == stack.operator_token  # what the gateway will accept
        assert len(stack.operator_token) == 48 and stack.operator_token != stack.default_token_file.read_text()
    finally:
        stack.stop()
