"""A tenant's tool process for test_tools_bus.py: `python tenant_tools.py TENANT` (NATS from
MARLAAS_NATS_URL). Each answer names the process, so tests can tell replicas apart."""

import os
import sys

from marlaas.tools import reward, serve, tool


@tool
def whoami(text: str, repeat: int = 1) -> str:
    """Echo ``text`` ``repeat`` times, prefixed by this process's id."""
    return f"{os.getpid()}:{text * repeat}"


@tool
async def as_json(n: int) -> dict:
    """A dict result (sent as JSON text), from an async tool."""
    return {"pid": os.getpid(), "squares": [i * i for i in range(n)]}


@tool
def explode(message: str) -> str:
    """Always raises."""
    raise RuntimeError(message)


@tool
def blob() -> bytes:
    """Returns bytes, which a tool may not."""
    return b"\x00\x01"


@reward("length")
def length(problem: dict, completion: str) -> float:
    """1.0 when the completion is as long as asked, else 0.0; problem {"n": -1} is out of range."""
    return 1.0 if len(completion) == problem["n"] else (-1.0 if problem["n"] < 0 else 0.0)


if __name__ == "__main__":
    serve(whoami, as_json, explode, blob, length, tenant=sys.argv[1])
