"""Who may do what on the broker: the ``auth.conf`` that nats-server includes, rendered from tenants.

One NATS account, two kinds of users:

- ``services``: every subject. The manager, rollout, env, trainer and gateway connect as it,
  and so do the operator's tools (``marlaas tenant``, ``status``, the test suite).
- one user per active tenant, named after it, whose password is the tenant's API token.
  The file holds only the token's bcrypt hash (nats-server checks ``$2a$`` passwords itself).
  What that user may do is :func:`tenant_permissions`: serve its own tools and rewards,
  announce its tools in the registry, hear its own jobs' events live, replay them through
  the one durable consumer per stream the platform made for it (:func:`replay_consumers`),
  and read replies on its own inbox prefix ``_INBOX_<tenant>`` (clients must set nats-py's
  ``inbox_prefix``). Never ``_INBOX.>`` (every reply in the account), never consumer
  creation (the server does not check a push consumer's ``deliver_subject`` against its
  creator's permissions), never DIRECT.GET / STREAM.MSG.GET (any stored message), nothing
  on TRAJ, no publish on a service subject.

The ``tenants`` KV bucket is the source of truth; this module only renders it. A new file
is validated with ``nats-server -t`` before it replaces the old one, and a SIGHUP makes the
server reload it without a restart: new users connect at once, removed users are cut off.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import bcrypt

SERVICES_USER = "services"
AUTH_FILE = "auth.conf"
# The token is a 128-bit random secret, so the work factor is not what protects it; the hash
# only keeps tokens out of the file. A low cost matters because nats-server re-checks every
# connected client's password on each reload, and each connect costs one check.
BCRYPT_ROUNDS = 6
# (stream, durable consumer name prefix, filter): the replay a tenant may read, one per stream.
REPLAY_STREAMS = (
    ("JOBS", "marlaas.job.*.{tenant}.>"),
    ("POLICY", "marlaas.policy.committed.{tenant}.>"),
)
TOOLS_KV_STREAM = "KV_tools"


class AuthConfigError(RuntimeError):
    """A rendered ``auth.conf`` that nats-server refuses, or a broker that cannot be reloaded."""


def bcrypt_hash(secret: str) -> str:
    """``secret``'s bcrypt hash in the ``$2a$`` form nats-server accepts as a password."""
    raw = secret.encode()
    if len(raw) > 72:  # bcrypt reads 72 bytes; anything past them would not be checked
        raise ValueError("a broker password must be at most 72 bytes")
    return bcrypt.hashpw(raw, bcrypt.gensalt(rounds=BCRYPT_ROUNDS, prefix=b"2a")).decode()


def inbox_prefix(tenant: str) -> str:
    """The reply-subject prefix a tenant's connection must use (nats-py ``inbox_prefix``)."""
    return f"_INBOX_{tenant}"


@dataclass(frozen=True)
class ReplayConsumer:
    """A durable pull consumer the platform keeps for one tenant on one stream."""

    stream: str
    name: str
    filter_subject: str


def replay_consumers(tenant: str) -> tuple[ReplayConsumer, ...]:
    """The consumers through which ``tenant`` replays its own jobs' events (``events-<tenant>``)."""
    return tuple(ReplayConsumer(stream, f"events-{tenant}", pattern.format(tenant=tenant))
                 for stream, pattern in REPLAY_STREAMS)


@dataclass(frozen=True)
class Permissions:
    """A NATS user's allow lists (everything else is denied)."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = True  # may answer the requests it receives, once each


def tenant_permissions(tenant: str) -> Permissions:
    """What a tenant's user may publish and subscribe to (see the module docstring)."""
    replay = replay_consumers(tenant)
    publish = [
        f"$KV.tools.{tenant}.>",  # announce its tools (a KV put is a publish)
        f"$JS.API.STREAM.INFO.{TOOLS_KV_STREAM}",  # opening the bucket reads its info
    ]
    for consumer in replay:
        publish += [
            f"$JS.API.CONSUMER.MSG.NEXT.{consumer.stream}.{consumer.name}",
            f"$JS.API.CONSUMER.INFO.{consumer.stream}.{consumer.name}",
            f"$JS.ACK.{consumer.stream}.{consumer.name}.>",
        ]
    subscribe = [
        f"marlaas.tool.{tenant}.>",
        f"marlaas.reward.{tenant}.>",
        f"marlaas.policy.committed.{tenant}.>",
        f"marlaas.job.*.{tenant}.>",
        f"{inbox_prefix(tenant)}.>",
    ]
    return Permissions(publish=tuple(publish), subscribe=tuple(subscribe))


def _quoted(text: str) -> str:
    if any(c in text for c in '"\\\n'):
        raise ValueError(f"{text!r} cannot be written into auth.conf")
    return f'"{text}"'


def _list(items: Iterable[str]) -> str:
    return "[" + ", ".join(_quoted(i) for i in items) + "]"


def render_auth(services_bcrypt: str, tenants: Iterable[tuple[str, str]]) -> str:
    """``auth.conf``: the services user, then one user per ``(tenant, token_bcrypt)``."""
    lines = [
        "# Generated by marlaas from the `tenants` KV bucket; edits are overwritten.",
        "authorization {",
        "  users = [",
        f"    {{user: {_quoted(SERVICES_USER)}, password: {_quoted(services_bcrypt)}}}",
    ]
    for tenant, token_bcrypt in sorted(tenants):
        if tenant == SERVICES_USER:
            raise ValueError(f"{SERVICES_USER!r} is the services' user, not a tenant name")
        perms = tenant_permissions(tenant)
        lines += [
            f"    {{user: {_quoted(tenant)}, password: {_quoted(token_bcrypt)}, permissions: {{",
            f"      publish: {{allow: {_list(perms.publish)}}}",
            f"      subscribe: {{allow: {_list(perms.subscribe)}}}",
            f"      allow_responses: {'true' if perms.allow_responses else 'false'}",
            "    }}",
        ]
    lines += ["  ]", "}", ""]
    return "\n".join(lines)


_SERVICES_LINE = re.compile(rf'^    \{{user: "{SERVICES_USER}", password: "([^"]+)"\}}$', re.M)


def with_services_password(text: str, password: str) -> str:
    """A rendered ``auth.conf`` whose services user has ``password`` (tenants kept as they are).

    The broker can start with its tenants' users before the ``tenants`` bucket is readable,
    which needs the broker. Returns ``text`` itself when the password already matches.
    """
    found = _SERVICES_LINE.search(text)
    if found is None:
        raise AuthConfigError("not an auth.conf that marlaas rendered (no services user line)")
    if bcrypt.checkpw(password.encode(), found[1].encode()):
        return text
    line = f"    {{user: {_quoted(SERVICES_USER)}, password: {_quoted(bcrypt_hash(password))}}}"
    return f"{text[:found.start()]}{line}{text[found.end():]}"


def check_auth_conf(path: Path, server_binary: str | None = None) -> None:
    """Raise :class:`AuthConfigError` unless nats-server accepts ``path`` as an ``include``.

    The check config sits beside ``path`` (nats-server resolves includes relative to the
    including file) and includes it, as the server's own config does.
    """
    from marlaas.embedded_nats import find_server_binary

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


def reload_server(pid_file: Path, log_file: Path | None = None, timeout_s: float = 10.0) -> int:
    """SIGHUP the nats-server whose pid is in ``pid_file``; return that pid.

    With ``log_file`` (the server's log), return only once the server logged that it
    reloaded, so a new user can connect and a revoked one is cut off when this returns;
    raise :class:`AuthConfigError` if it logged a failure instead.
    """
    import signal

    offset = log_file.stat().st_size if log_file is not None and log_file.exists() else 0
    try:
        pid = int(Path(pid_file).read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline")
        # a stale pid file must not make us SIGHUP (by default: kill) some other process
        if cmdline.parent.parent.exists() and b"nats-server" not in cmdline.read_bytes():
            raise ProcessLookupError(f"process {pid} is not a nats-server")
        os.kill(pid, signal.SIGHUP)
    except (OSError, ValueError) as exc:
        raise AuthConfigError(f"cannot reload the broker through {pid_file}: {exc}") from exc
    if log_file is not None:
        wait_for_reload(log_file, offset, timeout_s)
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


# --- credentials in URLs ----------------------------------------------------------------------
# A broker URL may list several servers (a cluster), comma-separated: ``nats://u:p@h:1,nats://u:p@h:2``.
# Each function below treats every server of such a list alike.


def server_urls(url: str) -> list[str]:
    """The servers of ``url``, one URL each (a single-server URL gives a list of one)."""
    return [part.strip() for part in url.split(",") if part.strip()]


def _one_with_credentials(url: str, user: str, password: str) -> str:
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}"
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))


def url_with_credentials(url: str, user: str, password: str) -> str:
    """``url`` with its user and password replaced on every server: ``nats://user:password@host:port``."""
    return ",".join(_one_with_credentials(one, user, password) for one in server_urls(url))


def url_credentials(url: str) -> tuple[str, str]:
    """``(user, password)`` of ``url`` (of its first server), empty strings where it carries none."""
    first = (server_urls(url) or [""])[0]
    parts = urlsplit(first)
    return unquote(parts.username or ""), unquote(parts.password or "")


def redact_url(url: str) -> str:
    """``url`` without its credentials (on any of its servers), for logs and messages."""
    redacted = []
    for one in server_urls(url) or [url]:
        parts = urlsplit(one)
        if "@" in parts.netloc:
            one = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
        redacted.append(one)
    return ",".join(redacted)
