"""What the gateway signs for Tinker clients: the SDK's short-lived JWT and expiring download URLs.

- The JWT: the SDK exchanges its API key for one (``POST /auth/token``, as ``client/config``'s
  ``pjwt_auth_enabled`` asks) and sends it instead of the key; ``RestClient.whoami`` reads the
  tenant from its claims. It names the tenant and a fingerprint of the tenant's token, so a revoked
  or replaced token voids its JWTs at once (the gateway checks both on every request).
- A download URL (``get_external_weights_urls``): one file of a checkpoint, for the tenant it was
  signed for, until ``expires``; a plain GET with no key downloads it.

Both are HMAC-SHA256 under keys derived from the operator's token (``gateway.operator_token``, which
every gateway replica has) with a fixed label each: nothing new to store or distribute, and a new
operator token voids every URL and JWT signed before (the SDK then exchanges its key again). These
are pure functions; the handlers are in ``tinker_api.py`` and ``tinker_checkpoints.py``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json

import msgspec

JWT_LABEL = b"marlaas tinker jwt v1"
URL_LABEL = b"marlaas tinker download url v1"
JWT_TTL_S = 900  # the SDK renews its JWT at half its life
URL_TTL_S = 3600  # a download URL's life (Tinker's: about an hour)
TOKEN_FINGERPRINT_CHARS = 16  # of the tenant token's sha256, in the JWT


def derived_key(secret: str, label: bytes) -> bytes:
    """The signing key for ``label``'s use, derived from ``secret`` (the operator's token)."""
    return hmac.new(secret.encode(), label, hashlib.sha256).digest()


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def mint_jwt(key: bytes, tenant: str, token_sha256: str, now: float) -> str:
    """An HS256 JWT for ``tenant``, valid ``JWT_TTL_S``; ``sub`` and ``org_id`` are what the SDK's
    ``whoami`` reports (as ``user_urn`` and ``org_urn``)."""
    header = b64(b'{"alg":"HS256","typ":"JWT"}')
    claims = {"iss": "marlaas", "sub": f"marlaas:tenant:{tenant}", "org_id": tenant, "iat": int(now),
              "exp": int(now) + JWT_TTL_S, "tok": token_sha256[:TOKEN_FINGERPRINT_CHARS]}
    payload = b64(json.dumps(claims, separators=(",", ":")).encode())
    signature = b64(hmac.new(key, f"{header}.{payload}".encode(), hashlib.sha256).digest())
    return f"{header}.{payload}.{signature}"


def jwt_claims(key: bytes, jwt: str, now: float) -> dict | None:
    """The claims of a JWT signed with ``key`` and not expired at ``now``; None for any other."""
    parts = jwt.split(".")
    if len(parts) != 3:
        return None
    header, payload, signature = parts
    expected = b64(hmac.new(key, f"{header}.{payload}".encode(), hashlib.sha256).digest())
    if not hmac.compare_digest(signature.encode(), expected.encode()):
        return None
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    if not isinstance(claims, dict) or not isinstance(claims.get("exp"), int) or claims["exp"] <= now:
        return None
    return claims


def token_matches(claims: dict, token_sha256: str) -> bool:
    """Whether a JWT's claims were minted for the tenant's current token."""
    return hmac.compare_digest(str(claims.get("tok", "")).encode(),
                               token_sha256[:TOKEN_FINGERPRINT_CHARS].encode())


def url_signature(key: bytes, reader: str, path: str, file: str, expires: str) -> str:
    """The signature of a download URL: ``file`` of the checkpoint ``path``, for the tenant
    ``reader``, until ``expires`` (Unix seconds, as the URL writes it). The fields are signed as one
    JSON list, so no field's text can pass for another's."""
    return hmac.new(key, msgspec.json.encode([reader, path, file, expires]), hashlib.sha256).hexdigest()


def url_problem(key: bytes, reader: str, path: str, file: str, expires: str, signature: str, now: float) -> str:
    """Why a download URL is refused ("" = it is good): a signature not of these fields (any of
    them changed), or an expiry passed."""
    expected = url_signature(key, reader, path, file, expires)
    if not hmac.compare_digest(signature.encode(), expected.encode()):
        return ("the URL's signature does not match it (changed, or not signed by this gateway): use the URLs "
                "get_external_weights_urls answers, as they are")
    if not expires.isdigit() or int(expires) <= now:
        return f"the URL expired (at {expires}, Unix time): ask get_external_weights_urls for fresh ones"
    return ""
