"""The manager's user API over NATS request/reply, and the job-submission format.

Subjects (``marlaas.platform.subjects.API_*``): ``marlaas.api.submit`` / ``.status`` /
``.cancel`` / ``.delete`` / ``.pin`` / ``.ping``, and ``.tinker_session`` / ``.tinker_model`` (the
gateway's Tinker API records a session or a model through the manager, which counts it against
the tenant's quota under the same lock as job submissions: gateway replicas cannot race past
it). Only platform users can publish on ``marlaas.api.*``: a tenant's NATS account has no import
of it. Replies carry ``error`` (for people) and ``code`` (for programs: the HTTP gateway maps it
to a status). A submission is the
same whether it comes from a TOML job file, CLI flags or the SDK: a
:class:`SubmitRequest`, checked for unknown keys (a typo fails loudly) and then
validated by the manager against the running stack.
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal, get_args

import msgspec

from marlaas.platform.events import EvalPoint, GrpoSettings, JobRecord, LoraSettings, SftSettings
from marlaas.platform.tinker_records import TinkerModel, TinkerSession

# reply codes: what kind of refusal an ``error`` is
INVALID = "invalid"  # the request itself is wrong (a submission's field, a version out of range)
QUOTA = "quota"  # the tenant already has its max_jobs (jobs and live Tinker models), or max_tinker_sessions
NOT_FOUND = "not_found"  # no such job for this tenant (another tenant's job reads the same)
FINISHED = "finished"  # the job already ended: it cannot be cancelled
UNAVAILABLE = "unavailable"  # the broker or store failed while recording it: nothing was created; retry
MAX_IDEMPOTENCY_KEY_CHARS = 128
MAX_THEN_CHAIN = 4  # a job's follow-ups ("then"), each starting when the one before completes
SET_FOR_FOLLOW_UPS = ("tenant", "init_from", "idempotency_key")


# sampling settings vLLM has but the trainer could not reproduce when it scores a batch
UNREPRODUCIBLE_SAMPLING = ("top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                           "frequency_penalty")


Priority = Literal["low", "normal", "high"]  # a job's order among its tenant's own engine requests
PRIORITIES: tuple[str, ...] = get_args(Priority)


class SubmitError(ValueError):
    """A job submission that cannot be accepted; the message says what to fix."""


class SubmitRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What a user submits. ``grpo`` / ``lora`` override the defaults key by key."""

    task: str
    steps: int
    name: str = ""  # "" = the task's name
    seed: int = 0
    tenant: str = "default"
    dataset: str | None = None
    corpus: str | None = None  # a JSONL of passages, for tasks that search the job's own documents
    tools: list[str] | None = None  # None = the task's own tools; [] = none
    reward: str = ""  # "<tenant>.<name>" (a reward function you serve) or a built-in one, instead of the task's
    system: str = ""  # the system prompt of every episode ("" = none)
    eval_every: int = 0  # score the committed version greedily on a held-out set every N versions
    eval_problems: int = 32
    eval_dataset: str | None = None  # held-out JSONL for dataset tasks
    grpo: GrpoSettings = msgspec.field(default_factory=GrpoSettings)
    lora: LoraSettings = msgspec.field(default_factory=LoraSettings)
    sft: SftSettings = msgspec.field(default_factory=SftSettings)  # the ``sft`` task's batch size and epochs
    init_from: str = ""  # version 0 from another of your jobs: "JOB@VERSION" or "JOB@latest"
    # a job to submit when this one completes, from its last version (``init_from`` set for it)
    then: dict[str, Any] | None = None
    # within your tenant's share of the engine: a high job's requests go before your normal and low ones
    priority: Priority = "normal"
    # the same key (per tenant) answers the same job: a client retrying a submission whose answer it
    # never got does not submit twice (the SDK sends one per submit; HTTP: the Idempotency-Key header)
    idempotency_key: str = ""


def _check_keys(tree: Any, type_: type, where: str) -> None:
    """Reject keys the (lenient) wire structs would silently ignore."""
    if not isinstance(tree, dict):
        return
    fields = {f.name: f for f in msgspec.structs.fields(type_)}
    for key, value in tree.items():
        if key in UNREPRODUCIBLE_SAMPLING and where.endswith("grpo."):
            raise SubmitError(f"'{where}{key}' is not supported: the trainer scores the full tempered "
                              "distribution, so only grpo.temperature may shape sampling")
        if key not in fields:
            raise SubmitError(f"unknown field '{where}{key}'; known fields: {', '.join(sorted(fields))}")
        if key in ("grpo", "lora", "sft"):
            _check_keys(value, {"grpo": GrpoSettings, "lora": LoraSettings, "sft": SftSettings}[key], f"{where}{key}.")
        if key == "then":
            _check_keys(value, SubmitRequest, f"{where}then.")
        if key == "priority" and value not in PRIORITIES:
            raise SubmitError(f"'{where}priority' is {value!r}: choose one of {', '.join(PRIORITIES)} (a high job's "
                              "requests go before your normal and low ones in the engine, within your share)")


def parse_submission(tree: dict) -> SubmitRequest:
    """A submission from a TOML / JSON tree; errors name the field. Its follow-ups (``then``,
    at most :data:`MAX_THEN_CHAIN` deep) are parsed too, so a mistake there is refused now."""
    _check_keys(tree, SubmitRequest, "")
    try:
        request = msgspec.convert(tree, SubmitRequest)
    except msgspec.ValidationError as exc:
        raise SubmitError(f"invalid job: {exc}") from exc
    chain, where = request, "then"
    while (chain := follow_up(chain, where)) is not None:
        where += ".then"
    return request


def follow_up(request: SubmitRequest, where: str = "then") -> SubmitRequest | None:
    """The job ``request.then`` describes, as its tenant's submission, or None; fields the
    platform sets for a follow-up (:data:`SET_FOR_FOLLOW_UPS`) are refused there."""
    if request.then is None:
        return None
    if where.count("then") > MAX_THEN_CHAIN:
        raise SubmitError(f"{where}: a chain of at most {MAX_THEN_CHAIN} follow-up jobs; submit the rest later")
    for key in SET_FOR_FOLLOW_UPS:
        if key in request.then:
            raise SubmitError(f"{where}.{key} is set for you (the follow-up runs as your tenant, from this job's "
                              f"last version): remove it")
    try:
        return msgspec.convert({**request.then, "tenant": request.tenant}, SubmitRequest)
    except msgspec.ValidationError as exc:
        raise SubmitError(f"invalid job in '{where}': {exc}") from exc


def follow_up_tree(then: dict[str, Any], tenant: str, parent: str) -> dict[str, Any]:
    """The submission that starts job ``parent``'s follow-up: from its last version, under a key
    that makes a repeated start (a redelivered last commit) answer the same job."""
    key = "then-" + hashlib.sha256(parent.encode()).hexdigest()[:32]
    return {**then, "tenant": tenant, "init_from": f"{parent}@latest", "idempotency_key": key}


class SubmitReply(msgspec.Struct, kw_only=True):
    id: str = ""
    error: str = ""
    code: str = ""  # INVALID, QUOTA or UNAVAILABLE when error is set


class TinkerSessionRequest(msgspec.Struct, kw_only=True):
    """Record ``session`` (a new Tinker session) if its tenant has fewer than
    ``manager.max_tinker_sessions`` live ones."""

    session: TinkerSession


class TinkerModelRequest(msgspec.Struct, kw_only=True):
    """Record ``model`` unless it exists, if its tenant's jobs and live models stay under
    ``max_jobs``; an existing model is answered as created (a retried ``create_model``)."""

    model: TinkerModel


class TinkerReply(msgspec.Struct, kw_only=True):
    """The recorded session's or model's id, or why not: ``code`` QUOTA (HTTP 429) or INVALID (400)."""

    id: str = ""
    error: str = ""
    code: str = ""


class StatusRequest(msgspec.Struct, kw_only=True):
    job: str = ""
    tenant: str = ""


class JobView(msgspec.Struct, kw_only=True):
    """One job as users see it (``marlaas status --json``)."""

    id: str
    name: str
    tenant: str
    task: str
    state: str
    reason: str
    version: int
    steps: int
    target_steps: int
    rewards: list[float]
    ttfs_s: float | None
    tpts_s: float | None
    tools: list[str] = []
    metrics: dict[str, list[float]] = {}  # agentic jobs: tool/* and episode/* figures per version
    evals: list[EvalPoint] = []  # held-out greedy scores: [{"version", "score"}]
    warnings: dict[str, str] = {}  # e.g. {"tool acme.weather": "has not answered since ..."}
    followed_by: str = ""  # the job its ``then`` started when it completed
    priority: str = "normal"  # within its tenant's share of the engine: "low", "normal" or "high"


def job_view(record: JobRecord) -> JobView:
    spec = record.spec
    return JobView(id=spec.id, name=spec.name, tenant=spec.tenant, task=spec.task,
                   state=record.state.value, reason=record.reason, version=record.version,
                   steps=record.steps_done, target_steps=spec.steps, rewards=record.rewards,
                   ttfs_s=record.ttfs_s, tpts_s=record.tpts_s, tools=list(spec.tools), metrics=record.metrics,
                   evals=record.evals, warnings=record.warnings, followed_by=record.followed_by,
                   priority=spec.priority)


class StatusReply(msgspec.Struct, kw_only=True):
    jobs: list[JobView] = []
    error: str = ""


class CancelRequest(msgspec.Struct, kw_only=True):
    job: str
    tenant: str = ""


class CancelReply(msgspec.Struct, kw_only=True):
    id: str = ""
    state: str = ""
    error: str = ""
    code: str = ""  # NOT_FOUND or FINISHED when error is set


class DeleteRequest(msgspec.Struct, kw_only=True):
    """Cancel ``job`` if it is unfinished, then remove its record, versions entry, objects and events."""

    job: str
    tenant: str = ""


class DeleteReply(msgspec.Struct, kw_only=True):
    id: str = ""
    deleted_objects: int = 0
    error: str = ""
    code: str = ""  # NOT_FOUND when error is set


class PinRequest(msgspec.Struct, kw_only=True):
    """Keep ``version`` of ``job`` (its adapter) through garbage collection."""

    job: str
    version: int
    tenant: str = ""


class PinReply(msgspec.Struct, kw_only=True):
    id: str = ""
    pinned: list[int] = []
    error: str = ""
    code: str = ""  # NOT_FOUND or INVALID when error is set
