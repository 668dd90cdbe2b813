"""``marlaas tenant``: add, list and revoke tenants; the broker's users follow.

The ``tenants`` KV bucket is the source of truth. Each command that changes it then
re-renders the broker's ``auth.conf`` from it (:func:`marlaas.stack.broker_auth.write_broker_auth`),
validates the file with ``nats-server -t`` and reloads the server with SIGHUP: a new tenant
can connect at once, a revoked one is cut off, nothing restarts. The commands connect as the
``services`` user (the URL of a running ``marlaas up``, or ``MARLAAS_NATS_URL``) and run where
the broker's ``auth.conf`` is: beside ``marlaas up`` (``<home>/nats/auth.conf``, reloaded
through its pid file), or in docker compose's ``admin`` container (``--auth-file`` /
``MARLAAS_NATS_AUTH_FILE``; then reload the broker yourself: ``docker compose kill -s HUP nats``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from marlaas.platform import nats_access
from marlaas.platform.config import Config
from marlaas.stack import broker_auth

AUTH_FILE_ENV = "MARLAAS_NATS_AUTH_FILE"
SERVICES_PASSWORD_ENV = "MARLAAS_NATS_PASSWORD"


def add_tenant_commands(subparsers) -> argparse.ArgumentParser:
    """Add ``tenant add | set | pause | resume | list | revoke | sync | init-auth | sandbox-password`` to the
    ``marlaas`` parser's subparsers."""
    tenant = subparsers.add_parser("tenant", help="add, set, pause, list or revoke tenants (API tokens, broker "
                                   "users, weights)")
    actions = tenant.add_subparsers(dest="tenant_command", required=True)

    def action(name: str, fn, help_: str) -> argparse.ArgumentParser:
        p = actions.add_parser(name, help=help_)
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.add_argument("--auth-file", help=f"the broker's auth.conf (default: ${AUTH_FILE_ENV}, "
                                           "else the embedded broker's under the home dir)")
        p.set_defaults(fn=fn)
        return p

    p = action("add", cmd_add, "add a tenant; prints its API token (shown only this once)")
    p.add_argument("name")
    p.add_argument("--max-jobs", type=int, default=None, help="jobs queued or running at once")
    p.add_argument("--max-samples", type=int, default=None,
                   help="samples per version of one job (grpo.prompts_per_step x grpo.group_size)")
    data_bounds(p)
    p = action("set", cmd_set, "change a tenant's weight (its share where tenants take turns) or quotas")
    p.add_argument("name")
    p.add_argument("--weight", type=float, default=None,
                   help="its share against the others' (default 1): 2 gets twice a tenant of 1 while both wait")
    p.add_argument("--max-jobs", type=int, default=None, help="jobs queued or running at once")
    p.add_argument("--max-samples", type=int, default=None, help="samples per version of one job")
    data_bounds(p)
    p = action("pause", cmd_pause, "pause a tenant: its jobs keep their state, their queued batches and Tinker "
               "requests wait (what is in hand finishes) until `marlaas tenant resume`")
    p.add_argument("name")
    p = action("resume", cmd_pause, "resume a paused tenant: its jobs go on from the versions they had")
    p.add_argument("name")
    action("list", cmd_list, "list tenants")
    p = action("revoke", cmd_revoke, "revoke a tenant: its token stops working, its connections drop")
    p.add_argument("name")
    action("sync", cmd_sync, "re-render the broker's users from the tenants bucket and reload it")
    action("init-auth", cmd_init_auth,
           f"before the broker starts: create auth.conf (services user only) or set its services "
           f"password; the password comes from ${SERVICES_PASSWORD_ENV}")
    action("sandbox-password", cmd_sandbox_password,
           f"print the broker password of the `sandbox` user (the python tool's service), which "
           f"derives from ${SERVICES_PASSWORD_ENV}: give it to the sandbox container alone")
    return tenant


# --- where the broker's auth lives ------------------------------------------------------------


@dataclass(frozen=True)
class BrokerFiles:
    """Where the broker's users live and, for the embedded one, how to reload it."""

    auth_file: Path | None  # None: not known here (nothing to render)
    # (pid file, log file) of each embedded server, to SIGHUP and to read the reload's outcome
    # from; empty: reload it yourself
    servers: tuple[tuple[Path, Path], ...] = ()


def broker_files(config: Config, auth_file: str | None) -> BrokerFiles:
    """The broker's files: ``auth_file`` or ``$MARLAAS_NATS_AUTH_FILE`` (reloaded by the
    operator), else the embedded broker's (one server, or each node of a cluster) when no
    NATS URL is configured."""
    given = auth_file or os.environ.get(AUTH_FILE_ENV)
    if given:
        return BrokerFiles(Path(given))
    if config.nats_url:
        return BrokerFiles(None)
    nats_dir = config.home_dir / "nats"
    pid_files = [nats_dir / "nats-server.pid", *sorted(nats_dir.glob("node-*/nats-server.pid"))]
    servers = tuple((pid, pid.with_name("nats-server.log")) for pid in pid_files if pid.exists())
    return BrokerFiles(nats_dir / broker_auth.AUTH_FILE, servers)


async def _with_bus(config: Config, fn):
    from marlaas.platform.bus import Bus
    from marlaas.sdk.discovery import running_nats_url

    url = running_nats_url(config)
    try:
        bus = await Bus.connect(url, name="marlaas-admin", timeout_s=10.0)
    except ConnectionError:
        raise ConnectionError(f"no NATS server answers at {nats_access.redact_url(url)} "
                              "(is marlaas up?)") from None
    try:
        return await fn(bus, url)
    finally:
        await bus.close()


async def _sync_broker(bus, url: str, config: Config, args) -> str:
    """Re-render and reload; return what happened: ``reloaded``, ``written`` or ``no-auth-file``."""
    from marlaas.stack.broker_auth import write_broker_auth

    files = broker_files(config, args.auth_file)
    if files.auth_file is None:
        return "no-auth-file"
    user, password = nats_access.url_credentials(url)
    if user != nats_access.SERVICES_USER or not password:
        raise broker_auth.AuthConfigError(
            f"the broker URL must carry the {nats_access.SERVICES_USER!r} user's password to render "
            "auth.conf (nats://services:PASSWORD@host:port)")
    reloaded = await write_broker_auth(bus, files.auth_file, password, files.servers)
    return "reloaded" if reloaded else "written"


def _broker_note(outcome: str) -> str:
    return {
        "reloaded": "the broker reloaded its users",
        "written": "auth.conf rewritten: now reload the broker (e.g. `docker compose kill -s HUP nats`)",
        "no-auth-file": f"the broker's users were NOT updated: pass --auth-file or set ${AUTH_FILE_ENV}, "
                        "then run `marlaas tenant sync`",
    }[outcome]


def data_bounds(p: argparse.ArgumentParser) -> None:
    """The flags of the bounds on the data one submission names (summed over its ``then`` chain)."""
    p.add_argument("--max-dataset-rows", type=int, default=None,
                   help="rows of the data files one submission names, every link of its `then` chain counted")
    p.add_argument("--max-dataset-bytes", type=int, default=None,
                   help="bytes of the data files one submission names, every link of its `then` chain counted")


def _print_json(obj) -> None:
    print(json.dumps(obj))


# --- commands -------------------------------------------------------------------------------


def cmd_add(args, config: Config) -> int:
    from marlaas.platform.tenants import add_tenant, tinker_api_key

    async def go(bus, url):
        given = {k: getattr(args, k) for k in ("max_jobs", "max_samples", "max_dataset_rows", "max_dataset_bytes")
                 if getattr(args, k) is not None}
        record, token = await add_tenant(bus, args.name, **given)
        try:
            outcome = await _sync_broker(bus, url, config, args)
        except Exception as exc:  # the tenant exists now: its token must still be shown
            return record, token, None, f"tenant {record.name!r} was added but the broker was not " \
                                        f"updated: {exc}; fix that, then run `marlaas tenant sync`"
        return record, token, outcome, None

    record, token, outcome, error = asyncio.run(_with_bus(config, go))
    if args.json:
        _print_json({"tenant": record.name, "token": token, "tinker_api_key": tinker_api_key(token),
                     **({"error": error} if error else {})})
    else:
        print(token)  # alone on stdout: TOKEN=$(marlaas tenant add NAME)
        print(f"tenant {record.name} added (max {record.max_jobs} jobs at once, {record.max_samples} samples "
              f"per version); the token above is shown only now (Tinker scripts: TINKER_API_KEY="
              f"{tinker_api_key('<token>')}). {_broker_note(outcome) if outcome else ''}",
              file=sys.stderr)
        if error:
            print(f"error: {error}", file=sys.stderr)
    return 2 if error else 0


def cmd_set(args, config: Config) -> int:
    from marlaas.platform.tenants import TenantError, set_tenant

    def refuse(error: str) -> int:
        if args.json:
            _print_json({"error": error})
        else:
            print(f"error: {error}", file=sys.stderr)
        return 2

    changes = {k: getattr(args, k) for k in ("weight", "max_jobs", "max_samples", "max_dataset_rows",
                                             "max_dataset_bytes") if getattr(args, k) is not None}
    if not changes:
        return refuse("say what to change: --weight W, --max-jobs N, --max-samples N, --max-dataset-rows N or "
                      "--max-dataset-bytes N")
    try:
        record = asyncio.run(_with_bus(config, lambda bus, url: set_tenant(bus, args.name, **changes)))
    except TenantError as exc:
        return refuse(str(exc))
    row = {"tenant": record.name, "weight": record.weight, "max_jobs": record.max_jobs,
           "max_samples": record.max_samples, "max_dataset_rows": record.max_dataset_rows,
           "max_dataset_bytes": record.max_dataset_bytes}
    if args.json:
        _print_json(row)
    else:
        print(f"tenant {record.name}: weight {record.weight:g}, max {record.max_jobs} jobs at once, "
              f"{record.max_samples} samples per version, {record.max_dataset_rows} rows and "
              f"{record.max_dataset_bytes} bytes of data per submission (the queues read the weight within 5 s)")
    return 0


def cmd_pause(args, config: Config) -> int:
    """``tenant pause NAME`` and ``tenant resume NAME``."""
    from marlaas.platform.tenants import TenantError, set_tenant

    paused = args.tenant_command == "pause"

    async def go(bus, url):
        record = await set_tenant(bus, args.name, paused=paused)
        await _note_pause(bus, record.name, paused)
        return record

    try:
        record = asyncio.run(_with_bus(config, go))
    except TenantError as exc:
        if args.json:
            _print_json({"error": str(exc)})
        else:
            print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        _print_json({"tenant": record.name, "paused": record.paused})
    elif record.paused:
        print(f"tenant {record.name} paused: within 5 s its queued batches and Tinker requests wait; what is "
              f"in hand finishes (each job may sample one more batch); `marlaas tenant resume {record.name}`")
    else:
        print(f"tenant {record.name} resumed: its jobs go on within 5 s")
    return 0


PAUSED_KEY = "tenant paused"


async def _note_pause(bus, tenant: str, paused: bool) -> None:
    """Say in each unfinished job's status that its tenant is paused (or clear it on resume)."""
    from marlaas.platform.bus import JOBS_BUCKET
    from marlaas.platform.commits import report_warning
    from marlaas.platform.events import JOB_RECORD

    note = "the operator paused this tenant: the job keeps its versions and goes on when resumed" if paused else ""
    for job in await bus.kv_keys(JOBS_BUCKET, under=tenant):
        entry = await bus.kv_get(JOBS_BUCKET, job)
        if entry is not None and not JOB_RECORD.decode(entry.value).state.finished:
            await report_warning(bus, job, "manager", PAUSED_KEY, note)


def cmd_list(args, config: Config) -> int:
    from marlaas.platform.tenants import list_tenants

    records = asyncio.run(_with_bus(config, lambda bus, url: list_tenants(bus)))
    rows = [{"name": r.name, "active": r.active, "max_jobs": r.max_jobs, "max_samples": r.max_samples,
             "max_dataset_rows": r.max_dataset_rows, "max_dataset_bytes": r.max_dataset_bytes,
             "weight": r.weight, "paused": r.paused, "created_at": r.created_at,
             "revoked_at": r.revoked_at} for r in records]
    if args.json:
        _print_json({"tenants": rows})
        return 0
    for row in rows:
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(row["created_at"]))
        state = "revoked" if not row["active"] else "paused" if row["paused"] else "active"
        print(f"{row['name']:<32} {state:<8} "
              f"max_jobs={row['max_jobs']:<4} max_samples={row['max_samples']:<5} weight={row['weight']:<6g} "
              f"created {created}")
    return 0


def cmd_revoke(args, config: Config) -> int:
    from marlaas.platform.tenants import revoke_tenant

    async def go(bus, url):
        record = await revoke_tenant(bus, args.name)
        return record, await _sync_broker(bus, url, config, args)

    record, outcome = asyncio.run(_with_bus(config, go))
    if args.json:
        _print_json({"tenant": record.name, "state": "revoked", "broker": outcome})
    else:
        print(f"tenant {record.name} revoked: its token is refused; {_broker_note(outcome)}")
    return 0 if outcome != "no-auth-file" else 2


def cmd_sync(args, config: Config) -> int:
    outcome = asyncio.run(_with_bus(config, lambda bus, url: _sync_broker(bus, url, config, args)))
    if args.json:
        _print_json({"broker": outcome})
    else:
        print(_broker_note(outcome))
    return 0 if outcome != "no-auth-file" else 2


def services_password(config: Config) -> str:
    """The services user's password: ``$MARLAAS_NATS_PASSWORD``, else the configured URL's."""
    password = os.environ.get(SERVICES_PASSWORD_ENV) or nats_access.url_credentials(config.nats_url)[1]
    if not password:
        raise ValueError(f"set ${SERVICES_PASSWORD_ENV} (the services user's NATS password)")
    return password


def cmd_sandbox_password(args, config: Config) -> int:
    """Print the ``sandbox`` user's password (``nats_access.sandbox_password`` of the services')."""
    password = nats_access.sandbox_password(services_password(config))
    if args.json:
        _print_json({"user": nats_access.SANDBOX_USER, "password": password})
    else:
        print(password)
    return 0


def cmd_init_auth(args, config: Config) -> int:
    """Before the broker starts: make sure ``auth.conf`` exists and knows the services' password
    (and the sandbox user's, derived from it).

    A first start gets the services user alone (tenants follow with ``marlaas tenant sync``
    once the broker runs); an existing file keeps its tenants, and its services user takes
    the password now configured (how a deployment changes it).
    """
    auth_file = broker_files(config, args.auth_file).auth_file
    if auth_file is None:
        raise ValueError(f"init-auth needs --auth-file or ${AUTH_FILE_ENV}")
    password = services_password(config)
    if auth_file.exists():
        text = auth_file.read_text()
        updated = broker_auth.with_services_password(text, password)
        outcome = "unchanged" if updated == text else "updated"
        if updated != text:
            broker_auth.write_auth_conf(auth_file, updated)
    else:
        outcome = "created"
        broker_auth.write_auth_conf(auth_file, broker_auth.render_auth(password, []))
    if args.json:
        _print_json({"auth_file": str(auth_file), "outcome": outcome})
    else:
        print(f"{auth_file}: {outcome}")
    return 0


# --- `marlaas usage`: the operator's view of metering -----------------------------------------


def add_usage_command(subparsers) -> argparse.ArgumentParser:
    """Add ``usage`` (every tenant's metered use, from the ``usage`` bucket) to the parser's subparsers."""
    p = subparsers.add_parser("usage", help="what each tenant's work used (engine tokens, trainer seconds, tools), "
                                            "by tenant, job or day; the operator's view")
    p.add_argument("--json", action="store_true", help="machine-readable output (the report and its records)")
    p.add_argument("--tenant", help="one tenant only")
    p.add_argument("--day", help="one UTC day only (YYYY-MM-DD)")
    p.add_argument("--by", choices=("tenant", "job", "day"), default="tenant", help="how rows are summed")
    p.set_defaults(fn=cmd_usage)
    return p


USAGE_COLUMNS = ("prefill_tokens", "generated_tokens", "train_tokens", "train_s", "tool_calls", "tool_s",
                 "tinker_requests")


def cmd_usage(args, config: Config) -> int:
    import msgspec

    from marlaas.platform.usage import read_usage, summarize

    records = asyncio.run(_with_bus(config, lambda bus, url: read_usage(bus, args.tenant or "")))
    report = summarize([r for r in records if not args.day or r.day == args.day], by_tenant=True)
    if args.json:
        print(json.dumps(msgspec.to_builtins(report)))
        return 0
    rows = {"tenant": report.by_tenant, "job": report.by_job, "day": report.by_day}[args.by]
    print(f"{args.by:<40} " + " ".join(f"{c:>16}" for c in USAGE_COLUMNS))
    for row in [*rows, type(rows[0])(key="total", counters=report.total)] if rows else []:
        cells = (getattr(row.counters, c) for c in USAGE_COLUMNS)
        print(f"{row.key:<40} " + " ".join(f"{v:>16.1f}" if isinstance(v, float) else f"{v:>16}" for v in cells))
    return 0
