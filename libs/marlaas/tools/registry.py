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

Only the platform writes the bucket. A tenant's tool process lives in the tenant's own NATS
account, with no JetStream: it sends its announcement to ``marlaas.registry.<tenant>.announce``
(:func:`request_announce`), which the platform imports from that account alone, and the
registrar (:func:`serve_registrar`, run by env) checks it and writes the entry. A tenant can
therefore announce only tools in its own namespace, and only tools the platform can reach.

The ``sandbox`` service (the python tool's own process, a restricted user of the platform's
account without JetStream) announces the same way on ``marlaas.registry.builtin.announce``: no
tenant can import that subject (``builtin`` is a reserved name), and through it only the tools of
:data:`REGISTRAR_BUILTINS` may be announced. The registrar answers only to an inbox (a reply
subject starting with ``_INBOX`` or ``_R_``), so a platform user cannot make it publish its answer
onto a JetStream subject such as ``$KV.jobs.<key>``.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Iterable

import msgspec
import nats.errors
import structlog

from marlaas.platform import subjects
from marlaas.platform.bus import BUCKETS, TOOLS_BUCKET, Bus
from marlaas.platform.events import Codec, EventDecodeError, ToolSpec, encode
from marlaas.tools.protocol import json_depth

log = structlog.get_logger("marlaas.tools")

BUILTIN = "builtin"
# rewards the env service serves for any task, named bare in a job spec: the LLM judge and the
# answer matchers (marlaas.tasks.matchers)
BUILTIN_REWARDS = ("judge", "exact", "contains", "numeric")
HEARTBEAT_S = 10.0  # at most; a bucket with a short TTL gets beats every TTL / 3
NAMESPACE_RE = re.compile(subjects.TENANT_NAME)  # a tenant's name ("builtin" is one too), fullmatch
TOOL_NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")
TOOL_SPEC = Codec("tool spec", ToolSpec)
MAX_SPEC_BYTES = 64 * 1024  # one tool's announcement: name, description and JSON schema
MAX_SPEC_DEPTH = 16  # nested objects and arrays of an announcement (a JSON schema needs a few)
MAX_TOOLS_PER_TENANT = 256
REACH_WAIT_S = 3.0  # how long a new tool may take to become reachable from the platform's account
MAX_PENDING_ANNOUNCEMENTS = 8  # per tenant, being checked at once; more are refused at once
REGISTRAR_BUILTINS = ("python",)  # built-ins announced through the registrar: the sandbox service's
REPLY_PREFIXES = ("_INBOX", "_R_")  # a client's inbox, or a reply mapped across accounts by an import


class ToolNameError(ValueError):
    """A tool or namespace name that cannot be a subject token."""


def check_namespace(namespace: str) -> str:
    """``namespace`` if it is ``builtin`` or a valid tenant name (lowercase letters, digits, '-')."""
    if not NAMESPACE_RE.fullmatch(namespace):
        raise ToolNameError(
            f"namespace {namespace!r} is not a tenant name: use 1-32 lowercase letters, digits and '-'"
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
    return subjects.tool(*split_qualified(qualified))


def reward_subject(name: str) -> str:
    """The request subject of a reward: ``marlaas.reward.<task>`` for a built-in task,
    ``marlaas.reward.builtin.<name>`` for a built-in reward (:data:`BUILTIN_REWARDS`, e.g.
    ``judge``; two tokens, so the env's per-task ``marlaas.reward.*`` does not match it), and
    ``marlaas.reward.<tenant>.<name>`` for a tenant's (``name`` = ``"<tenant>.<name>"``)."""
    if name in BUILTIN_REWARDS:
        return subjects.reward(BUILTIN, name)
    namespace, dot, reward = name.rpartition(".")
    if not dot:
        return subjects.task_reward(name)
    return subjects.reward(check_namespace(namespace), check_tool_name(reward))


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
    config = (await bus.js.stream_info(subjects.kv_stream(TOOLS_BUCKET))).config
    default = next(b.ttl_s for b in BUCKETS if b.name == TOOLS_BUCKET)
    return config.max_age or default


async def keep_announced(
    bus: Bus, specs: Iterable[ToolSpec], every_s: float | None = None, *, tenant: bool = False
) -> asyncio.Task:
    """Announce ``specs`` now, then keep re-announcing them in a background task (the heartbeat).

    ``tenant``: ``bus`` is a tenant's connection, which announces through the registrar
    (:func:`request_announce`) rather than writing the bucket. The interval is ``every_s``,
    else ``min(HEARTBEAT_S, TTL / 3)``, so an entry survives two missed beats. Cancel the
    returned task to stop; a failed beat (NATS reconnecting) is logged and retried at the next one.
    """
    specs = list(specs)
    if tenant:
        ttls = [await request_announce(bus, spec) for spec in specs]
        interval = every_s or min(HEARTBEAT_S, min(ttls) / 3)
    else:
        interval = every_s or min(HEARTBEAT_S, await registry_ttl_s(bus) / 3)
        for spec in specs:
            await announce_tool(bus, spec)

    async def beat() -> None:
        while True:
            await asyncio.sleep(interval)
            for spec in specs:
                try:
                    if tenant:
                        await request_announce(bus, spec)
                    else:
                        await announce_tool(bus, spec)
                except Exception as exc:  # tolerated: the next beat retries before the TTL runs out
                    log.warning("tool heartbeat failed", tool=spec.qualified, error=repr(exc))

    return asyncio.create_task(beat(), name="tool-heartbeat")


# --- announcements from tenants' accounts ------------------------------------------------------


class AnnounceRefused(RuntimeError):
    """The registrar refused a tenant's announcement (the reason says what to fix)."""


class AnnounceReply(msgspec.Struct, forbid_unknown_fields=False):
    """The registrar's answer: the bucket's TTL on success, else ``error``."""

    ttl_s: float = 0.0
    error: str = ""


ANNOUNCE_REPLY = msgspec.json.Decoder(AnnounceReply)


async def request_announce(bus: Bus, spec: ToolSpec, timeout_s: float = 10.0) -> float:
    """Ask the registrar to write (or refresh) ``spec``; return the registry's TTL in seconds.

    Raises :class:`AnnounceRefused` with the registrar's reason, or ``TimeoutError`` when no
    registrar answers within ``timeout_s`` (the platform's env service is down). "No
    responders" is retried meanwhile: a tenant account just added by a broker reload learns
    of the registrar a moment after it can connect.
    """
    subject, deadline = subjects.registry_announce(spec.namespace), time.monotonic() + timeout_s
    while True:
        try:
            reply = await bus.nc.request(subject, encode(spec), timeout=timeout_s)
            break
        except nats.errors.NoRespondersError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nobody answers on {subject}: is the platform's env service "
                                   "running?") from None
            await asyncio.sleep(0.1)
        except nats.errors.TimeoutError:
            raise TimeoutError(f"no reply on {subject} within {timeout_s:.0f}s") from None
    answer = ANNOUNCE_REPLY.decode(reply.data)
    if answer.error:
        raise AnnounceRefused(answer.error)
    return answer.ttl_s


async def _reachable(bus: Bus, qualified: str) -> bool:
    """Whether a request to the tool reaches a server now (interest crosses accounts a moment
    after the tenant subscribes). The probe is an empty body, which a server answers with an
    error result without running the tool."""
    deadline = time.monotonic() + REACH_WAIT_S
    while True:
        if await bus.answered(tool_subject(qualified), b"", timeout_s=REACH_WAIT_S):
            return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)


async def handle_announcement(bus: Bus, tenant: str, data: bytes) -> AnnounceReply:
    """Check one tenant's announcement and write it; every fault is an error reply."""
    if len(data) > MAX_SPEC_BYTES:
        return AnnounceReply(error=f"announcement is {len(data)} bytes; at most {MAX_SPEC_BYTES} "
                                   "(shorten the tool's description or schema)")
    if json_depth(data.decode(errors="replace"), MAX_SPEC_DEPTH) > MAX_SPEC_DEPTH:  # every job's prompt renders it
        return AnnounceReply(error=f"the tool's schema nests more than {MAX_SPEC_DEPTH} levels deep")
    try:
        spec = TOOL_SPEC.decode(data)
        check_namespace(tenant)
        check_tool_name(spec.name)
    except (EventDecodeError, ToolNameError) as exc:
        return AnnounceReply(error=str(exc))
    if spec.namespace != tenant:
        return AnnounceReply(error=f"tenant {tenant!r} may announce only its own tools "
                                   f"({tenant}.<tool>), not {spec.qualified!r}")
    if tenant == BUILTIN and spec.name not in REGISTRAR_BUILTINS:
        return AnnounceReply(error=f"{spec.qualified} is not announced through the registrar "
                                   f"(only {', '.join(REGISTRAR_BUILTINS)} is: env writes its own)")
    if await bus.kv_get(TOOLS_BUCKET, spec.qualified) is None:  # new: bounded, and reachable
        served = [k for k in await bus.kv_keys(TOOLS_BUCKET) if k.startswith(f"{tenant}.")]
        if len(served) >= MAX_TOOLS_PER_TENANT:
            return AnnounceReply(error=f"tenant {tenant!r} already serves {len(served)} tools, "
                                       f"the most allowed ({MAX_TOOLS_PER_TENANT})")
        if not await _reachable(bus, spec.qualified):
            return AnnounceReply(error=f"{spec.qualified} does not answer on "
                                       f"{tool_subject(spec.qualified)}: subscribe before announcing")
    await announce_tool(bus, spec)
    return AnnounceReply(ttl_s=await registry_ttl_s(bus))


def answers_to(reply: str) -> bool:
    """Whether the registrar may publish to ``reply``: an inbox, never a subject that some
    stream stores (a platform user's ``$KV.<bucket>.<key>`` would otherwise be written)."""
    return reply.startswith(REPLY_PREFIXES)


async def serve_registrar(bus: Bus):
    """Answer tenants' announcements (``marlaas.registry.*.announce``) on the platform's ``bus``,
    and the sandbox service's (``marlaas.registry.builtin.announce``).

    The tenant is the subject's third token: the broker imports that subject into a tenant's
    account only with the tenant's own name there, so it cannot be forged (``builtin`` is no
    tenant's: only the platform's users can publish it). A message whose reply subject is not an
    inbox (:func:`answers_to`) is dropped unread. Each announcement is
    checked in a task of its own (a new tool's reachability probe takes a moment); a tenant with
    :data:`MAX_PENDING_ANNOUNCEMENTS` being checked gets its next ones refused at once.
    """
    pending: dict[str, int] = {}
    tasks: set[asyncio.Task] = set()

    async def answer(msg, tenant: str) -> None:
        try:
            reply = await handle_announcement(bus, tenant, msg.data)
        except Exception as exc:  # the bus, not the tenant: say so, keep serving
            log.warning("announcement failed", tenant=tenant, error=repr(exc))
            reply = AnnounceReply(error=f"the registry could not be written now "
                                        f"({type(exc).__name__}); the next heartbeat retries")
        finally:
            pending[tenant] -= 1
        with contextlib.suppress(Exception):
            await msg.respond(msgspec.json.encode(reply))

    async def on_msg(msg) -> None:
        tenant = msg.subject.split(".")[2]
        if not answers_to(msg.reply):
            log.warning("announcement without an inbox to answer; dropped", tenant=tenant, reply=msg.reply[:64])
            return
        if pending.get(tenant, 0) >= MAX_PENDING_ANNOUNCEMENTS:
            with contextlib.suppress(Exception):
                await msg.respond(msgspec.json.encode(AnnounceReply(
                    error=f"{MAX_PENDING_ANNOUNCEMENTS} announcements of yours are still being "
                          "checked; announce each tool once and re-announce it as a heartbeat")))
            return
        pending[tenant] = pending.get(tenant, 0) + 1
        task = asyncio.create_task(answer(msg, tenant))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    return await bus.nc.subscribe(subjects.registry_announce("*"), queue="registry", cb=on_msg)


async def stop_heartbeat(task: asyncio.Task) -> None:
    """Cancel a :func:`keep_announced` task and wait for it to end."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
