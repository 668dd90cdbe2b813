"""How the ``marlaas`` commands print: JSON for scripts, errors as ``{"error"}`` or on stderr
(exit code 2), and a console for rich tables that keeps a row on one line when piped."""

from __future__ import annotations

import json
import sys

import msgspec

PIPE_WIDTH = 400  # piped or redirected output: wide enough that no id or reason is cut or wrapped


def print_json(obj) -> None:
    """``obj`` (a struct, or builtins) as one line of JSON on stdout."""
    print(json.dumps(msgspec.to_builtins(obj)))


def fail(message: str, as_json: bool) -> int:
    """Print ``message`` as an error (``{"error"}`` with ``--json``, else on stderr); the exit code, 2."""
    if as_json:
        print(json.dumps({"error": message}))
    else:
        print(f"error: {message}", file=sys.stderr)
    return 2


def stdout_console(**kwargs):
    """Rich's console for stdout; when stdout is not a terminal (a pipe, a file), one wide enough
    that a row stays one line (rich would otherwise lay the table out in 80 columns)."""
    from rich.console import Console

    return Console(**kwargs) if sys.stdout.isatty() else Console(width=PIPE_WIDTH, **kwargs)
