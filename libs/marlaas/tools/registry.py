"""Tool names, subjects and the registry of served tools (KV bucket ``tools``).

A tool's qualified name is ``<namespace>.<tool>``: the namespace is ``builtin`` for the
env service's tools and a tenant's name for theirs. A job spec names built-ins bare
(``search``) and a tenant's tools qualified (``acme.weather``). Calls go to
``marlaas.tool.<namespace>.<tool>`` (core request/reply, queue group), so the tenant sits
at a fixed token and one permission pattern per tenant covers its tools.

The registry holds one :class:`ToolSpec` per qualified name. Its entries expire (the
bucket's TTL, 30 s by default) and every server re-writes its tools' entries as a
heartbeat, so a tool whose last replica died disappears within one TTL. A replica that
stops cleanly does not delete the entry (another replica may still serve it): it lingers
until the TTL runs out.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Iterable

import msgspec
import structlog

from marlaas.bus import BUCKETS, TOOLS_BUCKET, Bus
from marlaas.events import Codec, ToolSpec, encode

log = structlog.get_logger("marlaas.tools")

BUILTIN = "builtin"
BUILTIN_REWARDS = ("judge",)  # rewards the env service serves for any task, named bare in a job spec
SUBJECT_PREFIX = "marlaas.tool"
HEARTBEAT_S = 10.0  # at most; a bucket with a short TTL gets beats every TTL / 3
NAMESPACE_RE = re.compile(r"[a-z0-9][a-z0-9-]*")
TOOL_NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")
TOOL_SPEC = Codec("tool spec", ToolSpec)


class ToolNameError(ValueError):
    """A tool or namespace name that cannot be a subject token."""


def check_namespace(namespace: str) -> str:
    """``namespace`` if it is ``builtin`` or a valid tenant name (lowercase letters, digits, '-')."""
    if not NAMESPACE_RE.fullmatch(namespace):
        raise ToolNameError(
            f"namespace {namespace!r} is not a tenant name: use lowercase letters, digits and '-'"
        )
    return namespace


def check_tool_name(name: str) -> str:
    """``name`` if it can be a tool's name (a letter, then letters, digits, '_' or '-')."""
    if not TOOL_NAME_RE.fullmatch(name):
        raise ToolNameError(
            f"tool name {name!r} is invalid: start with a letter, then letters, digits, '_' or '-'"
        )
    return name


def qualify(name: str) -> str:
    """The qualified name: ``"search"`` -> ``"builtin.search"``; ``"acme.weather"`` stays."""
    namespace, dot, tool = name.rpartition(".")
    if not dot:
        return f"{BUILTIN}.{check_tool_name(name)}"
    if "." in namespace:
        raise ToolNameError(f"tool {name!r} has more than one '.': write <tenant>.<tool>")
    return f"{check_namespace(namespace)}.{check_tool_name(tool)}"


def split_qualified(qualified: str) -> tuple[str, str]:
    """``(namespace, tool)`` of a name, qualifying it first."""
    namespace, _, tool = qualify(qualified).partition(".")
    return namespace, tool


def tool_subject(qualified: str) -> str:
    """The request subject of a tool: ``marlaas.tool.<namespace>.<tool>``."""
    return f"{SUBJECT_PREFIX}.{qualify(qualified)}"


def reward_subject(name: str) -> str:
    """The request subject of a reward: ``marlaas.reward.<task>`` for a built-in task,
    ``marlaas.reward.builtin.<name>`` for a built-in reward (:data:`BUILTIN_REWARDS`, e.g.
    ``judge``; two tokens, so the env's per-task ``marlaas.reward.*`` does not match it), and
    ``marlaas.reward.<tenant>.<name>`` for a tenant's (``name`` = ``"<tenant>.<name>"``)."""
    if name in BUILTIN_REWARDS:
        return f"marlaas.reward.{BUILTIN}.{name}"
    namespace, dot, reward = name.rpartition(".")
    if dot:
        check_namespace(namespace)
    return f"marlaas.reward.{namespace}.{check_tool_name(reward)}" if dot else f"marlaas.reward.{name}"


# --- the registry ---------------------------------------------------------------------------


async def announce_tool(bus: Bus, spec: ToolSpec) -> None:
    """Write (or refresh) ``spec`` in the registry, stamped with the current time."""
    stamped = msgspec.structs.replace(spec, announced_at=time.time())
    await bus.kv_put(TOOLS_BUCKET, qualify(spec.qualified), encode(stamped))


async def read_tool(bus: Bus, qualified: str) -> ToolSpec | None:
    """The registry's entry for a tool, or None when it was never announced or has expired."""
    entry = await bus.kv_get(TOOLS_BUCKET, qualify(qualified))
    return TOOL_SPEC.decode(entry.value) if entry else None


async def list_tools(bus: Bus, namespace: str | None = None) -> list[ToolSpec]:
    """Every live tool (optionally of one namespace), sorted by qualified name."""
    found = []
    for key in await bus.kv_keys(TOOLS_BUCKET):
        if namespace is not None and not key.startswith(f"{namespace}."):
            continue
        spec = await read_tool(bus, key)  # a key may expire between listing and reading
        if spec is not None:
            found.append(spec)
    return found


async def registry_ttl_s(bus: Bus) -> float:
    """How long a registry entry lives after its last heartbeat (the bucket's max age)."""
    await bus.kv_keys(TOOLS_BUCKET)  # opens (creates if missing) the bucket
    config = (await bus.js.stream_info(f"KV_{TOOLS_BUCKET}")).config
    default = next(b.ttl_s for b in BUCKETS if b.name == TOOLS_BUCKET)
    return config.max_age or default


async def keep_announced(
    bus: Bus, specs: Iterable[ToolSpec], every_s: float | None = None
) -> asyncio.Task:
    """Announce ``specs`` now, then keep re-announcing them in a background task (the heartbeat).

    The interval is ``every_s``, else ``min(HEARTBEAT_S, TTL / 3)``, so an entry survives two
    missed beats. Cancel the returned task to stop; a failed beat (NATS reconnecting) is
    logged and retried at the next one.
    """
    specs = list(specs)
    interval = every_s or min(HEARTBEAT_S, await registry_ttl_s(bus) / 3)
    for spec in specs:
        await announce_tool(bus, spec)

    async def beat() -> None:
        while True:
            await asyncio.sleep(interval)
            for spec in specs:
                try:
                    await announce_tool(bus, spec)
                except Exception as exc:  # tolerated: the next beat retries before the TTL runs out
                    log.warning("tool heartbeat failed", tool=spec.qualified, error=repr(exc))

    return asyncio.create_task(beat(), name="tool-heartbeat")


async def stop_heartbeat(task: asyncio.Task) -> None:
    """Cancel a :func:`keep_announced` task and wait for it to end."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
