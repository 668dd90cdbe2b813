"""A job submission as it arrives over HTTP: JSON or TOML bytes -> a checked submission tree.

Everything a user can get wrong before the manager sees the job is caught here with a
message that names the field and says what to do; the manager then validates the job
against the running stack (tasks, tools, budgets) and is the one that creates it.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path

import msgspec

from marlaas.platform import api
from marlaas.platform.http_api import PATH_FIELDS as DATA_FIELDS
from marlaas.platform.http_api import is_file_id
from marlaas.platform.limits import MAX_JSON_NESTING
from services.gateway.context import nesting_over

JSON_TYPES = ("application/json", "")  # no Content-Type: read as JSON
TOML_TYPES = ("application/toml", "text/x-toml", "text/toml")
EXAMPLE = '{"task": "addition", "steps": 10}'
AT_PATH = " - at `$"  # how msgspec ends an error with where it was: "... - at `$.grpo.seed`"
_MISSING = re.compile(r"Object missing required field `(?P<field>[^`]+)`")


class SubmissionRefused(ValueError):
    """A submission the gateway refuses; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def parse_body(body: bytes, content_type: str) -> dict:
    """The submission tree from a request body; JSON unless the Content-Type says TOML."""
    media = content_type.split(";", 1)[0].strip().lower()
    if not body.strip():
        raise SubmissionRefused(400, f"the request body is empty: send the job as JSON, e.g. {EXAMPLE}, "
                                     "or as TOML with Content-Type: application/toml")
    try:
        if media in TOML_TYPES:
            tree = parse_toml(body)
        elif media in JSON_TYPES or media.endswith("+json"):
            tree = parse_json(body)
        else:
            raise SubmissionRefused(415, f"Content-Type {media!r} is not accepted for a job: send "
                                         "application/json or application/toml")
    except RecursionError:  # the parser's own limit, far deeper than ours
        raise too_deep() from None
    if nesting_over(tree):  # arrays, objects and TOML tables alike
        raise too_deep()
    return tree


def split_error_path(text: str) -> tuple[str, str]:
    """A msgspec error's message and the path it names (``"grpo.seed"``; ``""`` when none), split
    with ``rfind``: the text holds the tenant's field names, so no regex that could backtrack."""
    at = text.rfind(AT_PATH)
    path = text[at + len(AT_PATH):-1] if at >= 0 and text.endswith("`") else ""
    if at < 0 or not text.endswith("`") or "`" in path:
        return text, ""
    return text[:at], path.lstrip(".")


def too_deep() -> SubmissionRefused:
    return SubmissionRefused(400, f"the job is nested more than {MAX_JSON_NESTING} levels deep (arrays, objects or "
                                  "tables within each other); a job needs 3 at most (a [grpo] table, a 'tools' "
                                  f"list): send its fields, e.g. {EXAMPLE}")


def parse_toml(body: bytes) -> dict:
    try:
        return tomllib.loads(body.decode("utf-8"))
    except UnicodeDecodeError:
        raise SubmissionRefused(400, "the TOML body is not UTF-8 text: save the job file as UTF-8") from None
    except tomllib.TOMLDecodeError as exc:
        raise SubmissionRefused(400, f"the body is not valid TOML ({exc}): fix the job file at that "
                                     "line and column") from None


def parse_json(body: bytes) -> dict:
    try:
        tree = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise SubmissionRefused(400, f"the body is not valid JSON ({exc}): send one JSON object, "
                                     f"e.g. {EXAMPLE}") from None
    if not isinstance(tree, dict):
        raise SubmissionRefused(400, f"the job must be a JSON object of fields, e.g. {EXAMPLE}; "
                                     f"got a {type(tree).__name__}")
    return tree


def check_submission(tree: dict, tenant: str, allow_paths_under: str = "", idempotency_key: str = "") -> dict:
    """Put the token's tenant into the tree and check its fields and types; return the tree.

    A body naming another tenant is refused (403): the tenant of a job is its token's. Its data
    (``dataset``, ``corpus``, ``eval_dataset``) must be uploaded files (see :func:`data_fields`).
    ``idempotency_key`` (the ``Idempotency-Key`` header) goes into the tree: the manager answers a
    repeated key with the job it created for it, so a client retrying after a 503 submits once.
    """
    named = tree.get("tenant")
    if named is not None and named != tenant:
        raise SubmissionRefused(403, f"field 'tenant' is {named!r}, but this token belongs to tenant {tenant!r}: "
                                     "drop 'tenant' (jobs always go to the token's tenant) or use that "
                                     "tenant's token")
    tree = {**tree, "tenant": tenant}
    if idempotency_key:
        tree["idempotency_key"] = idempotency_key
    try:
        api.parse_submission(tree)
    except api.SubmitError as exc:
        raise SubmissionRefused(400, explain(exc)) from None
    return data_fields(tree, allow_paths_under)


def data_fields(tree: dict, allow_paths_under: str = "") -> dict:
    """The tree with its data fields checked: each names an uploaded file (``file-...``, which
    the manager looks up among the tenant's own), or, only where the operator allows it
    (``gateway.allow_server_paths_under``), an absolute path inside that directory, sent on
    resolved. Whether a refused path exists on the server is never told."""
    allowed = Path(os.path.realpath(allow_paths_under)) if allow_paths_under else None
    for key in DATA_FIELDS:
        value = tree.get(key)
        if not value or is_file_id(value):
            continue
        resolved = Path(os.path.realpath(value)) if os.path.isabs(value) else None
        if allowed is None or resolved is None or not resolved.is_relative_to(allowed):
            raise SubmissionRefused(400, (
                f"field '{key}': {value!r} is not an uploaded file; a job names its data by file id: upload "
                f"the JSONL with POST /v1/files (it answers {{\"id\": \"file-...\"}}) and set {key} = "
                '"file-...", or let `marlaas submit` / the SDK upload a local file for you'))
        tree = {**tree, key: str(resolved)}
    if isinstance(tree.get("then"), dict):  # a follow-up's data are checked as its own job's are
        tree = {**tree, "then": data_fields(tree["then"], allow_paths_under)}
    return tree


def explain(exc: api.SubmitError) -> str:
    """A submission error as a message naming the field and the fix."""
    cause = exc.__cause__
    if not isinstance(cause, msgspec.ValidationError):
        message = str(exc)
        if message.startswith("unknown field"):
            message += " (remove it, or correct its spelling)"
        return message
    text = str(cause)
    missing = _MISSING.search(text)
    what, where = split_error_path(text)
    if missing:
        field = f"{where}.{missing['field']}" if where else missing["field"]
        return f"missing required field '{field}': every job needs 'task' and 'steps', e.g. {EXAMPLE}"
    what = what.replace("`", "")
    if not where:
        return f"invalid job: {what}; send an object of fields, e.g. {EXAMPLE}"
    return f"field '{where}': {what[:1].lower()}{what[1:]}; give '{where}' a value of that type"
