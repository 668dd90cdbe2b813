"""The broker's users as rendered: what a tenant may and may not do, and credentials in URLs."""

from __future__ import annotations

import re

import bcrypt
import pytest

from marlaas import natsauth
from marlaas.tenants import TenantError, check_tenant_name, new_token, tenant_of_token

pytestmark = pytest.mark.timeout(30)


def users(text: str) -> dict[str, str]:
    """Each user's line block in a rendered auth.conf, by name."""
    blocks = re.split(r"\n(?=    \{user: )", text)
    return {re.search(r'\{user: "([^"]+)"', b)[1]: b for b in blocks if "{user:" in b}


def allowed(block: str, kind: str) -> list[str]:
    return re.findall(r'"([^"]+)"', re.search(rf"{kind}: \{{allow: \[([^\]]*)\]", block)[1])


def test_services_user_may_do_everything_and_tenants_get_permissions():
    text = natsauth.render_auth("$2a$06$services", [("acme", "$2a$06$acme"), ("beta", "$2a$06$beta")])
    found = users(text)
    assert set(found) == {"services", "acme", "beta"}
    assert "permissions" not in found["services"] and '"$2a$06$services"' in found["services"]
    assert '"$2a$06$acme"' in found["acme"] and "allow_responses: true" in found["acme"]
    assert text.startswith("# Generated") and text.count("authorization {") == 1


def test_a_tenant_may_serve_hear_and_replay_only_its_own_subjects():
    perms = natsauth.tenant_permissions("acme")
    assert set(perms.subscribe) == {
        "marlaas.tool.acme.>", "marlaas.reward.acme.>", "marlaas.policy.committed.acme.>",
        "marlaas.job.*.acme.>", "_INBOX_acme.>",
    }
    assert set(perms.publish) == {
        "$KV.tools.acme.>", "$JS.API.STREAM.INFO.KV_tools",
        "$JS.API.CONSUMER.MSG.NEXT.JOBS.events-acme", "$JS.API.CONSUMER.INFO.JOBS.events-acme",
        "$JS.ACK.JOBS.events-acme.>",
        "$JS.API.CONSUMER.MSG.NEXT.POLICY.events-acme", "$JS.API.CONSUMER.INFO.POLICY.events-acme",
        "$JS.ACK.POLICY.events-acme.>",
    }
    rendered = users(natsauth.render_auth("$2a$06$x", [("acme", "$2a$06$y")]))["acme"]
    assert allowed(rendered, "publish") == list(perms.publish)
    assert allowed(rendered, "subscribe") == list(perms.subscribe)


@pytest.mark.parametrize("forbidden", [
    "CREATE", "DURABLE", "DELETE", "PURGE", "DIRECT.GET", "MSG.GET", "TRAJ", "trajectory",
    "marlaas.api", "marlaas.span", "$KV.jobs", "$KV.tenants", "_INBOX.",
])
def test_a_tenant_gets_no_dangerous_grant(forbidden):
    perms = natsauth.tenant_permissions("acme")
    granted = perms.publish + perms.subscribe
    assert ">" not in granted and not any(forbidden in subject for subject in granted)


def test_replay_consumers_are_filtered_to_the_tenant():
    consumers = {c.stream: c for c in natsauth.replay_consumers("acme")}
    assert consumers["JOBS"].filter_subject == "marlaas.job.*.acme.>"
    assert consumers["POLICY"].filter_subject == "marlaas.policy.committed.acme.>"
    assert {c.name for c in consumers.values()} == {"events-acme"}


def test_tenants_are_sorted_and_a_tenant_cannot_be_the_services_user():
    text = natsauth.render_auth("h", [("zeta", "z"), ("acme", "a")])
    assert text.index('user: "acme"') < text.index('user: "zeta"')
    with pytest.raises(ValueError, match="services"):
        natsauth.render_auth("h", [("services", "x")])
    with pytest.raises(TenantError):
        check_tenant_name("services")
    with pytest.raises(ValueError, match="cannot be written"):
        natsauth.render_auth('h"', [])


@pytest.mark.parametrize("name", ["builtin", "judge", "services", "platform", "sys", "$sys", "$G", "_inbox", "_x"])
def test_reserved_names_cannot_be_tenants(name):
    with pytest.raises(TenantError, match=rf"tenant name {re.escape(repr(name))} is reserved .*: choose another name"):
        check_tenant_name(name)
    assert check_tenant_name("builtins") == "builtins"  # only the names themselves


def test_the_hash_is_bcrypt_in_the_form_nats_server_reads_and_tokens_fit_in_it():
    token = new_token("a" * 32)  # the longest tenant name
    assert len(token.encode()) <= 72 and tenant_of_token(token) == "a" * 32
    hashed = natsauth.bcrypt_hash(token)
    assert hashed.startswith(f"$2a${natsauth.BCRYPT_ROUNDS:02d}$")
    assert bcrypt.checkpw(token.encode(), hashed.encode())
    assert not bcrypt.checkpw(new_token("a" * 32).encode(), hashed.encode())
    with pytest.raises(ValueError, match="72 bytes"):
        natsauth.bcrypt_hash("x" * 73)


def test_tenant_of_token_reads_only_well_formed_tokens():
    assert tenant_of_token(new_token("acme")) == "acme"
    assert tenant_of_token("mlt_acme_short") is None
    assert tenant_of_token("") is None


def test_credentials_in_urls():
    url = natsauth.url_with_credentials("nats://127.0.0.1:4222", "acme", "mlt_acme_00ff")
    assert url == "nats://acme:mlt_acme_00ff@127.0.0.1:4222"
    assert natsauth.url_credentials(url) == ("acme", "mlt_acme_00ff")
    assert natsauth.redact_url(url) == "nats://127.0.0.1:4222"
    replaced = natsauth.url_with_credentials(url, "services", "p@ss/word")
    assert natsauth.url_credentials(replaced) == ("services", "p@ss/word")
    assert natsauth.redact_url(replaced) == "nats://127.0.0.1:4222"
    assert natsauth.url_credentials("nats://nats:4222") == ("", "")
    assert natsauth.redact_url("nats://nats:4222") == "nats://nats:4222"
    assert natsauth.inbox_prefix("acme") == "_INBOX_acme"
