"""What the HTTP API answers, as msgspec Structs: the gateway encodes them, the SDK decodes them.

Readers accept fields they do not know (a newer gateway may add some); a field never
changes type. ``JobInfo`` has every field of ``marlaas.platform.api.JobView`` (what ``marlaas
status --json`` printed before the HTTP API) plus the queue position, pinned versions
and timestamps.
"""

from __future__ import annotations

import msgspec


class EvalInfo(msgspec.Struct, kw_only=True, frozen=True):
    """A held-out greedy score of one version (mean reward in [0, 1])."""

    version: int
    score: float


class JobInfo(msgspec.Struct, kw_only=True, frozen=True):
    """One job as its tenant sees it.

    ``rewards[i]`` is the mean reward of the batch trained at version ``i``; ``metrics``
    holds per-version agent figures (``tool/*``, ``episode/*``) the same way.
    ``queue_position`` is 1-based among all queued jobs in submission order (None unless
    queued). ``ttfs_s`` is the time to the first trained version, ``tpts_s`` the time
    per training step after it.
    """

    id: str
    name: str
    tenant: str
    task: str
    state: str  # queued | running | completed | failed | cancelled
    reason: str  # why it failed or was cancelled
    version: int  # latest committed version (-1 until admitted)
    steps: int  # trained versions so far
    target_steps: int
    rewards: list[float] = []
    ttfs_s: float | None = None
    tpts_s: float | None = None
    tools: list[str] = []
    metrics: dict[str, list[float]] = {}
    evals: list[EvalInfo] = []
    queue_position: int | None = None
    followed_by: str = ""  # the job its ``then`` started when it completed
    pinned: list[int] = []
    submitted_at: float = 0.0
    finished_at: float | None = None
    # what the job depends on and misbehaves now, e.g. {"reward acme.score": "not answering since
    # 12:03:41; ..."}: a tool or reward that answers nothing for rollout.give_up_s fails the job
    warnings: dict[str, str] = {}


class PhaseSpan(msgspec.Struct, kw_only=True, frozen=True):
    """When one phase of one version ran (unix seconds): ``generate`` and ``reward`` in rollout,
    ``train`` and ``commit`` in the trainer, ``eval`` for an evaluation. ``version`` is the
    policy the phase worked from (a ``commit`` span carries the version it made)."""

    version: int
    phase: str
    service: str
    start: float
    end: float


class VersionInfo(msgspec.Struct, kw_only=True, frozen=True):
    """A committed policy version: when, the figures of the batch that made it, and its adapter."""

    version: int
    committed_at: float
    metrics: dict[str, float] = {}  # e.g. reward/mean, loss, tool/calls (empty for version 0)
    pinned: bool = False
    adapter_sha256: str = ""
    adapter_bytes: int = 0

    @property
    def reward(self) -> float | None:
        return self.metrics.get("reward/mean")


class Event(msgspec.Struct, kw_only=True, frozen=True):
    """One server-sent event of a job: ``event`` is ``policy.committed``, ``job.state`` or ``job.eval``.

    ``id`` resumes the stream after this event (``Client.events(job, last_event_id=id)``).
    """

    id: str
    event: str
    data: dict = {}


class FileInfo(msgspec.Struct, kw_only=True, frozen=True):
    """One uploaded data file of the tenant (``POST /v1/files``, ``GET /v1/files``); a job names
    it by ``id`` (``dataset = "file-..."``). The id comes from the content: the same bytes
    uploaded again are the same file."""

    id: str
    size: int  # bytes
    sha256: str
    records: int  # JSON objects (non-blank lines)
    name: str = ""  # what the uploader called it (shown only; the first upload's name stays)
    created_at: float = 0.0


class FileDeleted(msgspec.Struct, kw_only=True, frozen=True):
    id: str
    deleted: bool = True


class AdapterInfo(msgspec.Struct, kw_only=True, frozen=True):
    """One uploaded LoRA adapter of the tenant (``POST /v1/adapters``, ``GET /v1/adapters``): a
    PEFT directory a job starts from with ``init_from = "adapter-..."``. The id comes from the
    content: the same two files uploaded again are the same adapter."""

    id: str
    rank: int  # the config's r
    alpha: int  # the config's lora_alpha
    target_modules: list[str]
    size: int  # bytes of both files
    sha256: str  # of adapter_model.safetensors
    name: str = ""  # what the uploader called it (shown only; the first upload's name stays)
    created_at: float = 0.0


class AdapterDeleted(msgspec.Struct, kw_only=True, frozen=True):
    id: str
    deleted: bool = True


class Submitted(msgspec.Struct, kw_only=True, frozen=True):
    id: str


class Cancelled(msgspec.Struct, kw_only=True, frozen=True):
    id: str
    state: str


class Deleted(msgspec.Struct, kw_only=True, frozen=True):
    id: str
    deleted_objects: int = 0


class Pinned(msgspec.Struct, kw_only=True, frozen=True):
    id: str
    pinned: list[int] = []


class SampleTurn(msgspec.Struct, kw_only=True, frozen=True):
    """One turn of an episode before its answer: the model's (``role = "model"``, with the tool
    call it wrote: ``tool`` and ``arguments``, or ``error`` saying why the call could not be read)
    or a tool's result (``role = "tool"``). Texts are cut to ``limits.MAX_SAMPLE_TEXT_CHARS``."""

    role: str  # model | tool
    text: str
    tool: str = ""
    arguments: str = ""  # the call's arguments, JSON text as the model wrote them
    error: str = ""


class SampleEpisode(msgspec.Struct, kw_only=True, frozen=True):
    """One rollout of its group's prompt: the turns before its answer, the answer (``completion``:
    the model's last turn, what the reward judged), its reward and its GRPO advantage (the reward
    normalized within its group, as the trainer computes it)."""

    reward: float
    advantage: float
    completion: str
    turns: list[SampleTurn] = []
    tokens: int = 0  # tokens after the prompt: the model's and the tools' results
    turns_cut: int = 0  # turns left out past limits.MAX_SAMPLE_TURNS


class SampleGroup(msgspec.Struct, kw_only=True, frozen=True):
    """One GRPO group of a version's batch: its prompt (as the model read it, template markup
    aside) and the episodes kept of it (``size`` counts them all)."""

    group: int
    prompt: str
    episodes: list[SampleEpisode]
    size: int  # the group's episodes in the batch (some may not be kept)
    reward_mean: float  # over all ``size`` episodes
    policy_version: int = -1  # the version that sampled it (the batch's at bounded staleness)
    batch_groups: int = 0  # groups in the version's batch (some may not be kept)


class VersionSamples(msgspec.Struct, kw_only=True, frozen=True):
    """``GET /v1/jobs/{id}/samples``: the episodes kept of one version's batch, group by group.

    ``version`` is the batch's step (the version that sampled it, but under bounded staleness:
    ``policy_version``); ``versions`` lists every version whose samples are kept, oldest first."""

    job: str
    version: int
    policy_version: int
    groups: list[SampleGroup]
    batch_groups: int
    versions: list[int]


PATH_FIELDS = ("dataset", "corpus", "eval_dataset")  # a job's data: local files, uploaded at submit


def is_file_id(value: object) -> bool:
    """Whether a job's data field names an uploaded file (``file-...``) rather than a path."""
    return isinstance(value, str) and value.startswith("file-")
