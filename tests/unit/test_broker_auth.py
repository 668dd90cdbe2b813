"""The broker's users as rendered: what a tenant may and may not do, and credentials in URLs."""

from __future__ import annotations

import re

import bcrypt
import pytest

from marlaas.platform import nats_access
from marlaas.platform.tenants import TOKEN_RE, TenantError, check_tenant_name, new_token, tenant_of_token
from marlaas.stack import broker_auth

pytestmark = pytest.mark.timeout(30)


def accounts(text: str) -> dict[str, str]:
    """Each account's block in a rendered auth.conf, by name."""
    blocks = re.split(r'\n(?=  "[^"]+": \{)', text)
    return {re.match(r'  "([^"]+)"', b)[1]: b for b in blocks[1:]}


def users(text: str) -> dict[str, str]:
    """Each user's line block in a rendered auth.conf, by name."""
    blocks = re.split(r"\n(?=    \{user: )", text)
    return {re.search(r'\{user: "([^"]+)"', b)[1]: b for b in blocks if "{user:" in b}


def allowed(block: str, kind: str) -> list[str]:
    return re.findall(r'"([^"]+)"', re.search(rf"{kind}: \{{allow: \[([^\]]*)\]", block)[1])


def test_the_platform_and_each_tenant_are_accounts_of_their_own():
    text = broker_auth.render_auth("services-pw", [("acme", "$2a$06$acme"), ("beta", "$2a$06$beta")])
    assert text.startswith("# Generated") and "authorization {" not in text
    assert "services-pw" not in text  # only its hash
    found = accounts(text)
    assert set(found) == {"PLATFORM", "acme", "beta"}
    assert "jetstream: enabled" in found["PLATFORM"]
    assert not any("jetstream" in found[t] for t in ("acme", "beta"))  # no JetStream for tenants
    assert set(users(found["PLATFORM"])) == {"services", "sandbox"} and set(users(found["acme"])) == {"acme"}
    assert "permissions" not in users(found["PLATFORM"])["services"]
    assert '"$2a$06$acme"' in found["acme"] and "allow_responses: true" in found["acme"]


def test_a_tenant_imports_only_subjects_with_its_own_name():
    found = accounts(broker_auth.render_auth("h", [("acme", "a"), ("beta", "b")]))
    platform, acme = found["PLATFORM"], found["acme"]
    # the platform exports each per-tenant subject with the tenant's token position ...
    assert re.findall(r'\{(stream|service): "([^"]+)", account_token_position: (\d)\}', platform) == [
        ("stream", "marlaas.policy.committed.*.>", "4"), ("stream", "marlaas.job.*.*.>", "4"),
        ("service", "marlaas.registry.*.announce", "3")]
    # ... each tenant imports its own, and serves its tools and rewards to the platform alone
    assert re.findall(r'\{(stream|service): \{account: "PLATFORM", subject: "([^"]+)"\}\}', acme) == [
        ("stream", "marlaas.policy.committed.acme.>"), ("stream", "marlaas.job.*.acme.>"),
        ("service", "marlaas.registry.acme.announce")]
    assert re.findall(r'\{service: "([^"]+)", accounts: \["PLATFORM"\]\}', acme) == [
        "marlaas.tool.acme.>", "marlaas.reward.acme.>"]
    assert re.findall(r'\{service: \{account: "(\w+)", subject: "([^"]+)"\}\}', platform) == [
        ("acme", "marlaas.tool.acme.>"), ("acme", "marlaas.reward.acme.>"),
        ("beta", "marlaas.tool.beta.>"), ("beta", "marlaas.reward.beta.>")]
    assert "beta" not in acme and "acme" not in found["beta"]


def test_inside_its_account_a_tenant_may_serve_hear_and_announce_only_its_own():
    perms = broker_auth.tenant_permissions("acme")
    assert set(perms.subscribe) == {
        "marlaas.tool.acme.>", "marlaas.reward.acme.>", "marlaas.policy.committed.acme.>",
        "marlaas.job.*.acme.>", "_INBOX_acme.>",
    }
    assert perms.publish == ("marlaas.registry.acme.announce",)
    rendered = users(broker_auth.render_auth("$2a$06$x", [("acme", "$2a$06$y")]))["acme"]
    assert allowed(rendered, "publish") == list(perms.publish)
    assert allowed(rendered, "subscribe") == list(perms.subscribe)


@pytest.mark.parametrize("forbidden", [
    "$JS", "$KV", "CREATE", "DURABLE", "DELETE", "PURGE", "DIRECT.GET", "MSG.GET", "TRAJ", "trajectory",
    "marlaas.platform.api", "marlaas.span", "_INBOX.",
])
def test_a_tenant_gets_no_dangerous_grant(forbidden):
    perms = broker_auth.tenant_permissions("acme")
    granted = perms.publish + perms.subscribe
    assert ">" not in granted and not any(forbidden in subject for subject in granted)


def test_tenants_are_sorted_and_a_tenant_cannot_be_the_services_user():
    text = broker_auth.render_auth("h", [("zeta", "z"), ("acme", "a")])
    assert text.index('user: "acme"') < text.index('user: "zeta"')
    for platform in ("services", "PLATFORM", "$G", "$SYS"):
        with pytest.raises(ValueError, match="platform's name"):
            broker_auth.render_auth("h", [(platform, "x")])
    with pytest.raises(TenantError):
        check_tenant_name("services")
    with pytest.raises(ValueError, match="cannot be written"):
        broker_auth.render_auth("h", [("acme", 'x"')])


# --- the sandbox user: the python tool's own service -------------------------------------------


def password_of(block: str) -> str:
    return re.search(r'password: "([^"]+)"', block)[1]


def test_the_sandbox_user_may_only_serve_the_python_tool_and_announce_it():
    perms = broker_auth.sandbox_permissions()
    assert perms.publish == ("marlaas.registry.builtin.announce",)
    # ... and hear the tenants' weights the manager broadcasts (its runs are shared by them)
    assert perms.subscribe == ("marlaas.tool.builtin.python tool-builtin", "_INBOX_sandbox.>", "marlaas.tenant.shares")
    assert perms.allow_responses
    block = users(accounts(broker_auth.render_auth("pw", []))["PLATFORM"])["sandbox"]
    assert allowed(block, "publish") == list(perms.publish)
    assert allowed(block, "subscribe") == list(perms.subscribe)
    assert "allow_responses: true" in block
    assert bcrypt.checkpw(nats_access.sandbox_password("pw").encode(), password_of(block).encode())
    with pytest.raises(ValueError, match="platform's name"):
        broker_auth.render_auth("h", [("sandbox", "x")])  # a user name is unique across accounts
    with pytest.raises(TenantError, match="reserved"):
        check_tenant_name("sandbox")


def test_the_sandbox_password_derives_one_way_from_the_services_password():
    derived = nats_access.sandbox_password("services-pw")
    assert derived == nats_access.sandbox_password("services-pw") and len(derived) == 48
    assert re.fullmatch(r"[0-9a-f]{48}", derived) and "services-pw" not in derived
    assert derived != nats_access.sandbox_password("services-pw2")


def test_every_rerender_with_the_services_password_keeps_the_sandbox_user():
    text = broker_auth.render_auth("pw", [("acme", "$2a$06$acme")])
    assert broker_auth.with_services_password(text, "pw") is text  # nothing to change
    changed = broker_auth.with_services_password(text, "pw2")
    sandbox = users(accounts(changed)["PLATFORM"])["sandbox"]
    assert bcrypt.checkpw(nats_access.sandbox_password("pw2").encode(), password_of(sandbox).encode())
    assert '"$2a$06$acme"' in changed
    older = "\n".join(line for line in text.splitlines() if '"sandbox"' not in line)  # before the sandbox
    added = broker_auth.with_services_password(older, "pw")
    assert set(users(accounts(added)["PLATFORM"])) == {"services", "sandbox"}
    assert broker_auth.with_services_password(added, "pw") is added


@pytest.mark.parametrize("name", ["builtin", "judge", "services", "sandbox", "platform", "sys", "$sys", "$G",
                                  "_inbox", "_x"])
def test_reserved_names_cannot_be_tenants(name):
    with pytest.raises(TenantError, match=rf"tenant name {re.escape(repr(name))} is reserved .*: choose another name"):
        check_tenant_name(name)
    assert check_tenant_name("builtins") == "builtins"  # only the names themselves


def test_the_hash_is_bcrypt_in_the_form_nats_server_reads_and_tokens_fit_in_it():
    token = new_token("a" * 32)  # the longest tenant name
    assert len(token.encode()) <= 72 and tenant_of_token(token) == "a" * 32
    hashed = nats_access.bcrypt_hash(token)
    assert hashed.startswith(f"$2a${nats_access.BCRYPT_ROUNDS:02d}$")
    assert bcrypt.checkpw(token.encode(), hashed.encode())
    assert not bcrypt.checkpw(new_token("a" * 32).encode(), hashed.encode())
    with pytest.raises(ValueError, match="72 bytes"):
        nats_access.bcrypt_hash("x" * 73)


def test_tenant_of_token_reads_only_well_formed_tokens():
    assert tenant_of_token(new_token("acme")) == "acme"
    assert tenant_of_token("mlt_acme_short") is None
    assert tenant_of_token("") is None


def test_credentials_in_urls():
    url = nats_access.url_with_credentials("nats://127.0.0.1:4222", "acme", "mlt_acme_00ff")
    assert url == "nats://acme:mlt_acme_00ff@127.0.0.1:4222"
    assert nats_access.url_credentials(url) == ("acme", "mlt_acme_00ff")
    assert nats_access.redact_url(url) == "nats://127.0.0.1:4222"
    replaced = nats_access.url_with_credentials(url, "services", "p@ss/word")
    assert nats_access.url_credentials(replaced) == ("services", "p@ss/word")
    assert nats_access.redact_url(replaced) == "nats://127.0.0.1:4222"
    assert nats_access.url_credentials("nats://nats:4222") == ("", "")
    assert nats_access.redact_url("nats://nats:4222") == "nats://nats:4222"
    assert nats_access.inbox_prefix("acme") == "_INBOX_acme"


@pytest.mark.parametrize("name", ["acme\n", "acme\n\n", "\nacme"])
def test_a_tenant_name_with_a_newline_is_refused(name):
    """``$`` matches before a trailing newline: names and tokens are anchored with ``\\Z``."""
    with pytest.raises(TenantError, match="is invalid"):
        check_tenant_name(name)
    assert TOKEN_RE.match(f"mlt_acme_{'0' * 32}\n") is None and TOKEN_RE.match(f"mlt_acme_{'0' * 32}")
