"""Every NATS subject the platform speaks on, built in one place (issue 36).

A job id (``<tenant>.<slug>-<hex>``) is the last tokens of a job's subjects, so one
permission pattern per tenant covers them (``libs/marlaas/stack/broker_auth.py``). Each
builder takes the job (or tenant); ``">"`` or ``"*"`` give the wildcard a consumer filters on.

==========================================  ==========  =====================================
subject                                     stream      from -> to
==========================================  ==========  =====================================
``marlaas.job.submitted.<job>``             JOBS        manager -> rollout, trainer
``marlaas.job.state.<job>``                 JOBS        manager -> watchers
``marlaas.job.eval.<job>``                  JOBS        rollout -> manager, watchers
``marlaas.job.failure.<job>``               JOBS        any service -> manager
``marlaas.job.warning.<job>``               JOBS        rollout -> manager
``marlaas.policy.committed.<job>``          POLICY      trainer (manager: v0) -> rollout, manager
``marlaas.trajectory.ready.<job>``          TRAJ        rollout -> trainer (work queue)
``marlaas.span.<job>``                      METRICS     every service -> manager, gateway
``marlaas.usage.<tenant>``                  USAGE       rollout, trainer -> manager (platform only)
``marlaas.tinker.train.<tenant>``           TINKER      gateway -> trainer (work queue)
``marlaas.tinker.sample.<tenant>``          TINKER      gateway -> rollout (work queue)
``marlaas.api.<call>``                      (core)      gateway, CLI -> manager (request/reply)
``marlaas.registry.<tenant>.announce``      (core)      a tenant's tool process -> env
``marlaas.tool.<namespace>.<tool>``         (core)      rollout -> env, sandbox, tenants' tools
``marlaas.reward.<task or ns.name>``        (core)      rollout -> env, tenants' rewards
==========================================  ==========  =====================================

A KV bucket's entries are messages too: key ``<key>`` of bucket ``<bucket>`` is subject
``$KV.<bucket>.<key>`` of stream ``KV_<bucket>`` (:func:`kv`, :func:`kv_stream`). The broker's
permissions (``libs/marlaas/stack/broker_auth.py``) are built from these builders too, so what a
tenant may reach is always what the services speak on.
"""

from __future__ import annotations

import re

PREFIX = "marlaas"
# a tenant's name: a subject token, a NATS account and user name. Its one home: JOB_ID here and
# marlaas.platform.tenants (TENANT_RE, TOKEN_RE) are built from it
TENANT_NAME = r"[a-z0-9][a-z0-9-]{0,31}"
# a job id, <tenant>.<slug>: both parts subject-safe, so an id can never widen a subject filter (a
# ">" or "*" in one would read all of a tenant's jobs at once). Used with fullmatch ("$" lets a "\n" by)
JOB_ID = re.compile(rf"({TENANT_NAME})\.[a-z0-9][a-z0-9-]{{0,63}}")


def is_job_id(value: object) -> bool:
    """Whether ``value`` is a well-formed job id (``<tenant>.<slug>``, lowercase letters, digits and '-')."""
    return isinstance(value, str) and JOB_ID.fullmatch(value) is not None


def job_submitted(job: str = ">") -> str:
    return f"{PREFIX}.job.submitted.{job}"


def job_state(job: str = ">") -> str:
    return f"{PREFIX}.job.state.{job}"


def job_eval(job: str = ">") -> str:
    return f"{PREFIX}.job.eval.{job}"


def job_failure(job: str = ">") -> str:
    return f"{PREFIX}.job.failure.{job}"


def job_warning(job: str = ">") -> str:
    return f"{PREFIX}.job.warning.{job}"


def job_events(job: str = ">") -> str:
    """Every kind of event of ``job`` (``">"``: the whole JOBS stream)."""
    return f"{PREFIX}.job.>" if job == ">" else f"{PREFIX}.job.*.{job}"


def tenant_job_events(tenant: str = "*") -> str:
    """Every kind of event of every job of ``tenant`` (a tenant's account imports them)."""
    return job_events(f"{tenant}.>")


def policy_committed(job: str = ">") -> str:
    return f"{PREFIX}.policy.committed.{job}"


def tenant_policy_committed(tenant: str = "*") -> str:
    """The commits of every job of ``tenant`` (a tenant's account imports them)."""
    return policy_committed(f"{tenant}.>")


TRAJECTORY_READY = f"{PREFIX}.trajectory.ready"  # .<tenant>.<name>: the trainer takes tenant turns on them


# core NATS, every few seconds from the manager: each tenant's weight, for a service whose broker user cannot
# read the tenants bucket (the sandbox); the manager's own copy of `marlaas.platform.tenants.tenant_shares`
TENANT_SHARES = f"{PREFIX}.tenant.shares"


def trajectory_ready(job: str = ">") -> str:
    return f"{TRAJECTORY_READY}.{job}"


def span(job: str = ">") -> str:
    return f"{PREFIX}.span.{job}"


def usage(tenant: str = "*") -> str:
    """Metering events of ``tenant``'s work (``marlaas.platform.usage``); no tenant account sees them."""
    return f"{PREFIX}.usage.{tenant}"


TINKER_TRAIN = f"{PREFIX}.tinker.train"  # .<tenant>: each tenant's queue (platform.tenant_turns reads them)
TINKER_SAMPLE = f"{PREFIX}.tinker.sample"


def tinker_train(tenant: str = "*") -> str:
    """A tenant's Tinker training requests, in the order they came."""
    return f"{TINKER_TRAIN}.{tenant}"


def tinker_sample(tenant: str = "*") -> str:
    """A tenant's Tinker sampling requests, any order."""
    return f"{TINKER_SAMPLE}.{tenant}"


def registry_announce(tenant: str) -> str:
    """Where ``tenant``'s tool processes send their announcements (env's registrar answers)."""
    return f"{PREFIX}.registry.{tenant}.announce"


TOOL = f"{PREFIX}.tool"  # .<namespace>.<tool>: marlaas.tools.registry.tool_subject checks the names
REWARD = f"{PREFIX}.reward"  # .<task> or .<namespace>.<name>: marlaas.tools.registry.reward_subject


def tool(namespace: str, name: str = ">") -> str:
    """The request subject of ``namespace``'s tool ``name`` (``">"``: every tool of the namespace)."""
    return f"{TOOL}.{namespace}.{name}"


def reward(namespace: str, name: str = ">") -> str:
    """The request subject of ``namespace``'s reward ``name`` (a built-in one's or a tenant's)."""
    return f"{REWARD}.{namespace}.{name}"


def task_reward(task: str = "*") -> str:
    """The request subject of a built-in task's own reward (``"*"``: every task's, as env serves them;
    one token, so it never matches a namespaced reward's two)."""
    return f"{REWARD}.{task}"


def kv_stream(bucket: str) -> str:
    """The JetStream stream that holds KV ``bucket``."""
    return f"KV_{bucket}"


def kv(bucket: str, key: str = ">") -> str:
    """The subject of ``key`` in KV ``bucket`` (a wildcard, e.g. ``"<tenant>.>"``, filters a read)."""
    return f"$KV.{bucket}.{key}"

# streams: what each holds (libs/marlaas/platform/bus.py creates them)
JOBS_STREAM = job_events(">")
POLICY_STREAM = f"{PREFIX}.policy.>"
TRAJ_STREAM = f"{PREFIX}.trajectory.>"
METRICS_STREAM = span(">")
TINKER_STREAM = f"{PREFIX}.tinker.>"
USAGE_STREAM = usage("*")

# the manager's request/reply API (a tenant's account imports none of it)
API_SUBMIT = f"{PREFIX}.api.submit"
API_STATUS = f"{PREFIX}.api.status"
API_CANCEL = f"{PREFIX}.api.cancel"
API_DELETE = f"{PREFIX}.api.delete"
API_PIN = f"{PREFIX}.api.pin"
API_PING = f"{PREFIX}.api.ping"  # the manager answers: readiness checks, nothing read
API_TINKER_SESSION = f"{PREFIX}.api.tinker_session"
API_TINKER_MODEL = f"{PREFIX}.api.tinker_model"
