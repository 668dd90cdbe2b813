"""The HTTP SDK: a tenant's synchronous client for the gateway (``marlaas.Client``).

    from marlaas import Client

    client = Client.from_env()   # MARLAAS_URL / MARLAAS_TOKEN, else the local `marlaas up`
    job = client.submit({"task": "reverse", "steps": 40})
    for event in client.events(job):
        print(event.event, event.data)
    client.download(job, "adapter/")     # a PEFT directory

A job's data (``dataset``, ``corpus``, ``eval_dataset``) is named by uploaded file id: ``submit``
uploads each local file a job names (once per content: a file the tenant already has is reused
by its sha256) and sends the id; ``upload`` / ``files`` / ``delete_file`` manage them directly.
Likewise a job's ``init_from`` naming a local PEFT adapter directory: ``submit`` uploads it
(``upload_adapter``) and sends its id (``adapter-...``).

Every refusal raises a :class:`MarlaasError` subclass carrying the server's message,
which says what to fix.
"""

from __future__ import annotations

import hashlib
import os
import tarfile
import tempfile
import time
import tomllib
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import msgspec

from marlaas.platform.adapter_archives import adapter_archive
from marlaas.platform.adapter_uploads import adapter_id_of, is_adapter_id
from marlaas.platform.adapters import CONFIG_FILE, WEIGHTS_FILE
from marlaas.platform.http_api import (
    PATH_FIELDS,
    AdapterDeleted,
    AdapterInfo,
    Cancelled,
    Deleted,
    Event,
    FileDeleted,
    FileInfo,
    JobInfo,
    PhaseSpan,
    Pinned,
    Submitted,
    VersionInfo,
    VersionSamples,
    is_file_id,
)
from marlaas.sdk import discovery


class MarlaasError(RuntimeError):
    """The API refused a request (or could not be reached); ``message`` says what to fix."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.message, self.status = message, status


class BadRequest(MarlaasError):
    """The request was wrong (4xx other than below): a field, a value, a version."""


class Unauthorized(MarlaasError):
    """The token is missing, malformed, unknown or revoked (401)."""


class NotFound(MarlaasError):
    """No such job for this tenant, or no such version (404)."""


class QuotaExceeded(MarlaasError):
    """The tenant already has its max_jobs queued or running (429)."""


class ServerError(MarlaasError):
    """The gateway or the manager failed or is unavailable (5xx): retry later."""


_BY_STATUS = {401: Unauthorized, 404: NotFound, 429: QuotaExceeded}


def _raise_for(response: httpx.Response) -> None:
    if response.is_success:
        return
    try:
        message = msgspec.json.decode(response.read()).get("error") or response.reason_phrase
    except (msgspec.DecodeError, AttributeError):
        message = f"HTTP {response.status_code} {response.reason_phrase}"
    kind = _BY_STATUS.get(response.status_code) or (ServerError if response.status_code >= 500 else BadRequest)
    raise kind(message, response.status_code)


def read_job_file(path: str | os.PathLike) -> dict:
    """A TOML job file as a submission; relative data paths are made absolute (relative to the file)."""
    path = Path(path)
    if not path.is_file():
        raise BadRequest(f"job file {path} does not exist")
    try:
        job = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise BadRequest(f"job file {path} is not valid TOML: {exc}") from None
    return with_absolute_paths(job, path.parent)


def with_absolute_paths(job: dict, folder: Path) -> dict:
    """``job`` with its data paths (and its follow-up's, ``then``) made absolute, relative to ``folder``."""
    job = dict(job)
    for key in PATH_FIELDS:
        if isinstance(job.get(key), str) and not is_file_id(job[key]):
            job[key] = str((folder / Path(job[key]).expanduser()).resolve())
    if looks_like_path(job.get("init_from")):  # a local adapter directory, uploaded at submit
        job["init_from"] = str((folder / Path(job["init_from"]).expanduser()).resolve())
    if isinstance(job.get("then"), dict):
        job["then"] = with_absolute_paths(job["then"], folder)
    return job


def looks_like_path(init_from: object) -> bool:
    """Whether a job's ``init_from`` names a local directory rather than a job's version
    (``JOB@VERSION`` never holds a '/'), a Tinker checkpoint (``tinker://...``) or an uploaded
    adapter (``adapter-...``)."""
    return (isinstance(init_from, str) and not init_from.startswith("tinker://")
            and ("/" in init_from or init_from.startswith((".", "~"))))


def parse_sse(lines: Iterator[str]) -> Iterator[Event]:
    """Events from text/event-stream lines (comments and retry fields skipped)."""
    fields: dict[str, str] = {}
    data: list[str] = []
    for line in lines:
        if line == "":
            if data or fields.get("event"):
                payload = msgspec.json.decode("\n".join(data)) if data else {}
                yield Event(id=fields.get("id", ""), event=fields.get("event", "message"), data=payload)
            fields, data = {}, []
        elif not line.startswith(":"):
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "data":
                data.append(value)
            elif name in ("id", "event"):
                fields[name] = value


SUBMIT_RETRIES_S = (2.0, 4.0)  # a submission without an answer is sent again (same Idempotency-Key) after these


class Client:
    """A tenant's handle on the HTTP API at ``url``, authenticated by ``token``."""

    def __init__(self, url: str, token: str, timeout_s: float = 60.0) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s,
                                  headers={"Authorization": f"Bearer {token}"})

    @classmethod
    def from_env(cls, home: str | os.PathLike | None = None, timeout_s: float = 60.0,
                 wait_s: float = discovery.STARTUP_WAIT_S, on_wait: Callable[[str], None] | None = None) -> Client:
        """``MARLAAS_URL`` and ``MARLAAS_TOKEN``, else the local stack's: the URL in
        ``<home>/run/gateway.url`` and the default tenant's token in
        ``<home>/run/default-tenant.token`` (home: ``home``, else the config's).

        A local stack that is still starting (``marlaas up &`` a moment ago) is waited for, up to
        ``wait_s``; ``on_wait`` hears once that it is (the CLI prints it)."""
        url, token = os.environ.get("MARLAAS_URL", ""), os.environ.get("MARLAAS_TOKEN", "")
        if not url or not token:
            if home is None:
                from marlaas.platform.config import load_config

                home = load_config().home_dir
            run = Path(home).expanduser() / "run"
            try:
                discovery.wait_until_ready(run, wait_s, on_wait=on_wait)
            except discovery.StackNotReady as exc:
                raise MarlaasError(f"{exc}; or set MARLAAS_URL and MARLAAS_TOKEN") from None
            url = url or _read_marker(run / "gateway.url", "the gateway's URL")
            token = token or _read_marker(run / "default-tenant.token", "the default tenant's token")
        return cls(url, token, timeout_s)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _request(self, method: str, path: str, **kwargs) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise ServerError(f"no answer from {self.url} ({exc}): is marlaas up?") from exc
        _raise_for(response)
        return response

    def _get(self, path: str, type_: type, **kwargs):
        return msgspec.json.decode(self._request("GET", path, **kwargs).content, type=type_)

    def submit(self, job: dict | str | os.PathLike) -> str:
        """Submit a job (a dict of job-file fields, or the path of a TOML job file); returns its id.
        Local files named in its data fields are uploaded first (see :meth:`with_uploaded_data`).

        A submission that got no answer (a 5xx, or none at all) is sent again, twice
        (``SUBMIT_RETRIES_S``), with the same ``Idempotency-Key``: the manager answers a
        repeated key with the job it created for it, so a retry never submits the job twice."""
        body = read_job_file(job) if isinstance(job, (str, os.PathLike)) else dict(job)
        body = self.with_uploaded_data(body)
        headers = {"Content-Type": "application/json", "Idempotency-Key": uuid.uuid4().hex}
        for delay in SUBMIT_RETRIES_S:
            try:
                return self._post_job(body, headers)
            except ServerError:
                time.sleep(delay)
        return self._post_job(body, headers)

    def _post_job(self, body: dict, headers: dict[str, str]) -> str:
        reply = self._request("POST", "/v1/jobs", content=msgspec.json.encode(body), headers=headers)
        return msgspec.json.decode(reply.content, type=Submitted).id

    def with_uploaded_data(self, job: dict) -> dict:
        """``job`` with each local path in its data fields (relative to the working directory, or
        to the job file) replaced by the id of that file uploaded: a file the tenant already has
        (the same sha256) is not sent again. An ``init_from`` naming a local directory (a PEFT
        adapter) is replaced by the id of that adapter uploaded, likewise once."""
        if isinstance(job.get("then"), dict):  # a follow-up's data too
            job = {**job, "then": self.with_uploaded_data(job["then"])}
        init = job.get("init_from")
        if isinstance(init, str) and not is_adapter_id(init) and (looks_like_path(init) or Path(init).is_dir()):
            job = {**job, "init_from": self._uploaded_adapter(init)}
        local = {key: job[key] for key in PATH_FIELDS
                 if isinstance(job.get(key), str) and job[key] and not is_file_id(job[key])}
        if not local:
            return job
        held = {f.sha256: f.id for f in self.files()}
        uploaded = {}
        for key, value in local.items():
            path = Path(value).expanduser()
            try:
                data = path.read_bytes()
            except OSError as exc:
                raise BadRequest(f"{key} = {value!r}: cannot read that local file ({exc.strerror}): give the "
                                 "path of your JSONL file (relative to the job file), or an uploaded file's id "
                                 "(file-...)") from None
            digest = hashlib.sha256(data).hexdigest()
            if digest not in held:
                held[digest] = self._upload_bytes(data, path.name).id
            uploaded[key] = held[digest]
        return {**job, **uploaded}

    def _uploaded_adapter(self, value: str) -> str:
        """The id of the adapter in the local directory ``value`` (an ``init_from``), uploaded
        unless the tenant has it already."""
        folder = Path(value).expanduser()
        if not folder.is_dir():
            raise BadRequest(f"init_from = {value!r}: no such local directory: give the PEFT adapter directory "
                             "(relative to the job file), an uploaded adapter's id (adapter-...), JOB@VERSION or a "
                             "tinker:// path")
        config_json, weights = read_adapter_dir(folder)
        adapter_id = adapter_id_of(config_json, weights)
        if adapter_id in {a.id for a in self.adapters()}:
            return adapter_id
        return self._upload_adapter_files(config_json, weights, folder.name).id

    def upload_adapter(self, path: str | os.PathLike, name: str = "") -> AdapterInfo:
        """Upload a local PEFT LoRA adapter directory (``adapter_config.json`` and
        ``adapter_model.safetensors``, as peft's ``save_pretrained`` writes it); a job starts from
        it with ``init_from`` = the ``id`` returned."""
        folder = Path(path).expanduser()
        return self._upload_adapter_files(*read_adapter_dir(folder), name or folder.name)

    def _upload_adapter_files(self, config_json: bytes, weights: bytes, name: str) -> AdapterInfo:
        reply = self._request("POST", "/v1/adapters", params={"name": name},
                              content=adapter_archive(config_json, weights, time.time()),
                              headers={"Content-Type": "application/gzip"})
        return msgspec.json.decode(reply.content, type=AdapterInfo)

    def adapters(self) -> list[AdapterInfo]:
        """Your uploaded adapters, oldest first."""
        return self._get("/v1/adapters", list[AdapterInfo])

    def delete_adapter(self, adapter_id: str) -> bool:
        """Delete one of your uploaded adapters."""
        reply = self._request("DELETE", f"/v1/adapters/{adapter_id}")
        return msgspec.json.decode(reply.content, type=AdapterDeleted).deleted

    def upload(self, path: str | os.PathLike) -> FileInfo:
        """Upload a local JSONL file (a dataset or a corpus); a job names it by the ``id`` returned."""
        path = Path(path).expanduser()
        return self._upload_bytes(path.read_bytes(), path.name)

    def _upload_bytes(self, data: bytes, name: str) -> FileInfo:
        reply = self._request("POST", "/v1/files", params={"name": name}, content=data,
                              headers={"Content-Type": "application/jsonl"})
        return msgspec.json.decode(reply.content, type=FileInfo)

    def files(self) -> list[FileInfo]:
        """Your uploaded data files, oldest first."""
        return self._get("/v1/files", list[FileInfo])

    def delete_file(self, file_id: str) -> bool:
        """Delete one of your data files."""
        return msgspec.json.decode(self._request("DELETE", f"/v1/files/{file_id}").content, type=FileDeleted).deleted

    def jobs(self) -> list[JobInfo]:
        """Your jobs, in submission order."""
        return self._get("/v1/jobs", list[JobInfo])

    def job(self, job: str) -> JobInfo:
        return self._get(f"/v1/jobs/{job}", JobInfo)

    def cancel(self, job: str) -> str:
        """Cancel a queued or running job; returns its new state."""
        return msgspec.json.decode(self._request("POST", f"/v1/jobs/{job}/cancel").content, type=Cancelled).state

    def delete(self, job: str) -> int:
        """Delete a job and all of it (cancelled first if unfinished); returns the objects removed."""
        return msgspec.json.decode(self._request("DELETE", f"/v1/jobs/{job}").content, type=Deleted).deleted_objects

    def versions(self, job: str) -> list[VersionInfo]:
        """The job's committed versions, oldest first."""
        return self._get(f"/v1/jobs/{job}/versions", list[VersionInfo])

    def timeline(self, job: str) -> list[PhaseSpan]:
        """When each of the job's phases ran (generate, reward, train, commit, eval), oldest first."""
        return self._get(f"/v1/jobs/{job}/timeline", list[PhaseSpan])

    def samples(self, job: str, version: int | None = None) -> VersionSamples:
        """The episodes kept of a version's batch, group by group (prompt, turns, tool calls,
        answer, reward, advantage); the newest version with samples unless ``version``."""
        params = {} if version is None else {"version": version}
        return self._get(f"/v1/jobs/{job}/samples", VersionSamples, params=params)

    def pin(self, job: str, version: int) -> list[int]:
        """Keep ``version``'s adapter through garbage collection; returns the pinned versions."""
        reply = self._request("POST", f"/v1/jobs/{job}/versions/{version}/pin")
        return msgspec.json.decode(reply.content, type=Pinned).pinned

    def download(self, job: str, out_dir: str | os.PathLike, version: int | None = None) -> Path:
        """Unpack a version's adapter (latest by default) into ``out_dir``, a PEFT directory; return it.
        ``job`` may also be a Tinker checkpoint's ``tinker://`` path (docs/tinker.md)."""
        out = Path(out_dir)
        if job.startswith("tinker://"):
            url, params = "/v1/tinker/checkpoint", {"path": job}
        else:
            url, params = f"/v1/jobs/{job}/adapter", {"version": version} if version is not None else None
        with tempfile.TemporaryFile() as archive:
            try:
                with self._http.stream("GET", url, params=params) as response:
                    _raise_for(response)
                    for chunk in response.iter_bytes():
                        archive.write(chunk)
            except httpx.TransportError as exc:
                raise ServerError(f"download from {self.url} failed ({exc}): retry") from exc
            archive.seek(0)
            out.mkdir(parents=True, exist_ok=True)
            with tarfile.open(fileobj=archive, mode="r:gz") as tar:
                tar.extractall(out, filter="data")  # refuses absolute paths, links out, devices
        return out

    def events(self, job: str, last_event_id: str | None = None) -> Iterator[Event]:
        """The job's events as they happen, from the start or after ``last_event_id``; ends after
        the job's final state and last version. Each event's ``id`` resumes after it."""
        headers = {"Accept": "text/event-stream"}
        if last_event_id:
            headers["Last-Event-ID"] = last_event_id
        timeout = httpx.Timeout(self._http.timeout.connect, read=60.0)  # the server sends a keepalive every 15 s
        try:
            with self._http.stream("GET", f"/v1/jobs/{job}/events", headers=headers, timeout=timeout) as response:
                _raise_for(response)
                yield from parse_sse(response.iter_lines())
        except httpx.TransportError as exc:
            raise ServerError(f"the event stream from {self.url} broke ({exc}): resume with the last "
                              "event's id") from exc


def read_adapter_dir(folder: Path) -> tuple[bytes, bytes]:
    """The (config JSON, weights) of the PEFT adapter directory ``folder``."""
    try:
        return (folder / CONFIG_FILE).read_bytes(), (folder / WEIGHTS_FILE).read_bytes()
    except OSError as exc:
        raise BadRequest(f"{folder} is not a PEFT adapter directory: cannot read {Path(exc.filename).name} "
                         f"({exc.strerror}); it needs {CONFIG_FILE} and {WEIGHTS_FILE}, as peft's "
                         "save_pretrained writes them") from None


def _read_marker(path: Path, what: str) -> str:
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        raise MarlaasError(f"{what} is not in {path}: start the stack with `marlaas up`, or set "
                           "MARLAAS_URL and MARLAAS_TOKEN") from None
