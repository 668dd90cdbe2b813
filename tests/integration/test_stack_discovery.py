"""A client waiting on a local stack that is starting, whose launcher process has died (a real
process that exited, so the pid is one the machine really gave)."""

from __future__ import annotations

import pytest


def test_a_client_is_told_when_the_starting_stack_died(tmp_path, monkeypatch):
    import subprocess

    import msgspec

    from marlaas.sdk import Client, MarlaasError, discovery

    monkeypatch.delenv("MARLAAS_URL", raising=False)
    monkeypatch.delenv("MARLAAS_TOKEN", raising=False)
    gone = subprocess.Popen(["true"])
    gone.wait()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / discovery.STATE_FILE).write_bytes(
        msgspec.json.encode(discovery.StackState(state=discovery.STARTING, pid=gone.pid)))
    with pytest.raises(MarlaasError, match=f"pid {gone.pid}.*exited"):
        Client.from_env(home=tmp_path, wait_s=30)
