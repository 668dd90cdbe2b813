"""How a client reaches the broker: the platform's user and account names, the sandbox's
password, a tenant's registry subject and inbox prefix, token hashes, and credentials in broker URLs."""

from __future__ import annotations

import hashlib
import hmac
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import bcrypt

SERVICES_USER = "services"
# The python tool's own service: a user of the platform's account that may only serve that tool
# and announce it (marlaas.stack.broker_auth.sandbox_permissions); it never holds the services' password.
SANDBOX_USER = "sandbox"

PLATFORM_ACCOUNT = "PLATFORM"


# The token is a 128-bit random secret, so the work factor is not what protects it; the hash
# only keeps tokens out of the file. A low cost matters because nats-server re-checks every
# connected client's password on each reload, and each connect costs one check.
BCRYPT_ROUNDS = 6


def bcrypt_hash(secret: str) -> str:
    """``secret``'s bcrypt hash in the ``$2a$`` form nats-server accepts as a password."""
    raw = secret.encode()
    if len(raw) > 72:  # bcrypt reads 72 bytes; anything past them would not be checked
        raise ValueError("a broker password must be at most 72 bytes")
    return bcrypt.hashpw(raw, bcrypt.gensalt(rounds=BCRYPT_ROUNDS, prefix=b"2a")).decode()


def sandbox_password(services_password: str) -> str:
    """The ``sandbox`` user's password, derived from the services' (HMAC-SHA256, 48 hex digits).

    Every path that renders ``auth.conf`` knows the services' password, so each renders the same
    sandbox user without another secret to store; the derivation is one-way, so the sandbox's
    password tells nothing of the services'. In compose the operator sets it
    (``marlaas tenant sandbox-password`` prints it).
    """
    digest = hmac.new(services_password.encode(), b"marlaas sandbox", hashlib.sha256).hexdigest()
    return digest[:48]


def inbox_prefix(tenant: str) -> str:
    """The reply-subject prefix a tenant's (or the sandbox's) connection must use (nats-py ``inbox_prefix``)."""
    return f"_INBOX_{tenant}"


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
