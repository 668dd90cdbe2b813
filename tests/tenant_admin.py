"""`marlaas tenant ARGV --json` run in the test's process against the stack under a home
(tests/ is on sys.path beside conftest.py, so any test imports this)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json

from marlaas.platform.config import load_config
from marlaas.stack.admin import add_tenant_commands


def tenant_cli(home, *argv: str) -> tuple[int, dict]:
    """(exit code, the JSON it printed); a tool served meanwhile may log to stdout too."""
    parser = argparse.ArgumentParser(prog="marlaas")
    add_tenant_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["tenant", *argv, "--json"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = args.fn(args, load_config(env={"MARLAAS_HOME": str(home)}))
    [printed] = [line for line in out.getvalue().splitlines() if line.startswith("{")][-1:]
    return code, json.loads(printed)


def tenant_cli_ok(home, *argv: str) -> dict:
    """The JSON of a ``marlaas tenant`` command that must succeed."""
    code, out = tenant_cli(home, *argv)
    assert code == 0, out
    return out
