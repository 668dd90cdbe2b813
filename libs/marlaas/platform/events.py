"""Wire contracts: every event that crosses the bus, as msgspec Structs.

One tagged union per stream, one typed decoder built once per union. Rules for
evolving these types (msgspec's): new fields get defaults, a field never changes
type, and nothing here is ``array_like``. Wire structs accept unknown fields so
an old reader can decode a newer writer's event. This module imports neither
torch nor vllm: every service, the CLI and the SDK can afford it.
"""

from __future__ import annotations

import enum
from typing import Generic, TypeVar

import msgspec

SCHEMA_VERSION = 1


class EventDecodeError(ValueError):
    """Bytes on a stream that are not a valid event of that stream."""


class Wire(msgspec.Struct, frozen=True, kw_only=True):
    """Base of the plain (untagged) wire structs."""


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    """Base of every tagged event; ``schema`` lets readers tell writers apart."""

    schema: int = SCHEMA_VERSION


# --- job specs ---------------------------------------------------------------------------


# what becomes of an episode that ends before the model answered (length, max_tool_calls, context_full)
TRUNCATED_MODES = ("train", "zero", "drop")
PIPELINE_MODES = ("groups", "batch")


class GrpoSettings(Wire):
    """How one job samples and updates: GRPO groups, clipping, KL, optimizer."""

    prompts_per_step: int = 8
    group_size: int = 8
    max_new_tokens: int = 0  # 0 = the task's own budget
    temperature: float = 1.0
    learning_rate: float = 2e-3
    clip_eps: float = 0.2
    scale_by_std: bool = True  # GRPO divides advantages by the group's std; False = Dr. GRPO
    kl_coef: float = 0.0
    max_grad_norm: float = 1.0
    weight_decay: float = 0.0
    # benchmarks: every turn runs to its token budget (EOS is sampled like any token, and the turn
    # goes on after it), so completion length is fixed; the logprobs stay the policy's own
    ignore_eos: bool = False
    # an episode that ended by length, max_tool_calls or context_full: "train" = scored and trained
    # like any other; "zero" = reward 0 (a penalty for not answering); "drop" = left out of the batch
    # (DAPO's overlong filtering: not trained on, not part of its group's baseline)
    truncated: str = "train"
    # "batch": the whole batch is published, then trained; "groups": rollout publishes each GRPO group
    # as soon as it is scored and the trainer adds its gradients while later groups are still
    # generated, stepping once the batch is whole (the same update, strictly on-policy). "batch" is
    # the default: on the 2-core CPU the per-group costs outweigh the overlap (docs/throughput.md)
    pipeline: str = "batch"
    # bounded staleness: rollout samples batch s with the newest committed version b while the trainer
    # trains, as long as s - b <= max_staleness; 0 = strictly on-policy (every batch sampled by the
    # version it trains). A stale batch is trained with the decoupled objective (see grpo.py)
    max_staleness: int = 0


class LoraSettings(Wire):
    """The job's adapter shape (peft ``LoraConfig`` fields)."""

    rank: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: tuple[str, ...] = (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    )


class SftSettings(Wire):
    """How an ``sft`` job goes through its conversations (its optimizer settings are ``grpo``'s)."""

    batch_size: int = 8  # conversations a step
    epochs: int = 0  # times through the dataset; sets the job's steps (0: the job's ``steps`` as given)


class JobSpec(Wire):
    """A validated, admitted-or-queued job. ``id`` is ``<tenant>.<slug>``."""

    id: str
    tenant: str
    name: str
    task: str
    steps: int
    seed: int = 0
    dataset: str | None = None  # a local JSONL path for tasks that take user data
    corpus: str | None = None  # a local JSONL of passages, for tasks whose search tool reads the job's own
    tools: tuple[str, ...] = ()  # tools the model may call, as named in the spec ("search", "acme.weather")
    tool_specs: tuple[ToolSpec, ...] = ()  # their registry entries when submitted: the prompt stays fixed
    reward: str = ""  # "<tenant>.<name>" (a user's reward function) or a built-in one, instead of the task's
    system: str = ""  # the system prompt of every episode ("" = none)
    eval_every: int = 0  # score the committed version greedily every N versions (0 = never)
    eval_problems: int = 32  # size of the held-out set
    eval_dataset: str | None = None  # a held-out JSONL for dataset tasks (else a fixed held-out draw)
    grpo: GrpoSettings = msgspec.field(default_factory=GrpoSettings)
    lora: LoraSettings = msgspec.field(default_factory=LoraSettings)
    sft: SftSettings = msgspec.field(default_factory=SftSettings)
    # where version 0 comes from ("" = a fresh adapter): "JOB@VERSION" / "JOB@latest", a job of the
    # same tenant (services/manager/warm_start.py); resolved at submission into ``init_adapter``
    init_from: str = ""
    init_adapter: Blob | None = None  # version 0's weights, copied from the source at submission
    then: str = ""  # JSON of the submission started when this job completes ("" = none; api.follow_up)
    submitted_at: float = 0.0
    priority: str = "normal"  # "low" | "normal" | "high": its requests' order among its tenant's in the engine


class JobState(str, enum.Enum):  # noqa: UP042 -- StrEnum would change str() and f"{state}" to the bare value
    """Lifecycle: queued -> running -> completed | failed | cancelled."""

    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        return self in (JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED)


class Blob(Wire):
    """A payload that travels by reference: written fully before it is announced."""

    uri: str
    sha256: str
    size: int = 0


# --- JOBS stream: marlaas.job.<kind>.<job> ------------------------------------------------


class JobSubmitted(Event, tag="job.submitted"):
    spec: JobSpec


class JobStateChanged(Event, tag="job.state"):
    job: str
    state: JobState
    reason: str = ""
    at: float = 0.0


class JobFailureReported(Event, tag="job.failure"):
    """A service met a fault that is the job's own (non-finite loss, bad data)."""

    job: str
    service: str
    reason: str
    version: int = -1


class JobWarningReported(Event, tag="job.warning"):
    """Something the job depends on misbehaves (a tool or reward that stopped answering): shown in
    the job's status under ``key`` until a report with an empty ``warning`` clears it."""

    job: str
    service: str
    key: str
    warning: str = ""
    at: float = 0.0


class JobEvaluated(Event, tag="job.eval"):
    """Version ``version`` scored greedily on the job's held-out set (mean reward in [0, 1])."""

    job: str
    version: int
    score: float
    problems: int = 0
    at: float = 0.0


JobEvent = JobSubmitted | JobStateChanged | JobFailureReported | JobWarningReported | JobEvaluated


# --- POLICY stream: marlaas.policy.committed.<job> ----------------------------------------


class PolicyCommitted(Event, tag="policy.committed"):
    """Version ``version`` of ``job`` is committed; ``metrics`` describe the batch that made it."""

    job: str
    version: int
    adapter: Blob
    batch_id: str = ""  # "" for version 0 (the seeded init)
    metrics: dict[str, float] = {}
    committed_at: float = 0.0


PolicyEvent = PolicyCommitted


# --- TRAJ stream: marlaas.trajectory.ready.<job> ------------------------------------------


class Sample(Wire):
    """One completion: token ids, the engine's sampling logprobs, its loss mask and reward."""

    group: int
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    loss_mask: list[int]
    reward: float
    text: str = ""


class TrajectoryBatch(Wire):
    """One GRPO step's worth of samples, all drawn from one policy version."""

    samples: list[Sample]
    # the adapter version the engine served while sampling, as rollout recorded it (-1: unknown);
    # the audit compares it with the trainer's own record, independently of the trainer's check
    policy_version: int = -1
    metrics: dict[str, float] = {}  # rollout's per-batch figures (tool calls, turns, tool wait...)
    # what the samples train: "grpo" (rewards -> group advantages, the clipped policy gradient) or
    # "sft" (the cross-entropy of the masked tokens: a supervised batch, the same samples otherwise)
    objective: str = "grpo"


class TrajectoryReady(Event, tag="trajectory.ready"):
    """A batch sampled with ``version``, or one GRPO group of it (``group`` >= 0, one of ``groups``:
    ``grpo.pipeline = "groups"``); inline when small, else by ``batch_ref``."""

    job: str
    version: int
    batch_id: str
    batch: TrajectoryBatch | None = None
    batch_ref: Blob | None = None
    sampled_at: float = 0.0
    group: int = -1  # -1: the whole batch
    groups: int = 0  # how many groups make the batch (when ``group`` >= 0)


TrajectoryEvent = TrajectoryReady


# --- core request/reply: marlaas.tool.<ns>.<tool>, marlaas.reward.<task> ------------------


class ToolCall(Event, tag="tool.call"):
    job: str
    call_id: str
    tool: str
    arguments: str = "{}"  # JSON text, as the model wrote it
    context: dict[str, str] = {}  # set by the job's task, not the model (e.g. {"corpus": path})


class ToolResult(Event, tag="tool.result"):
    call_id: str
    output: str = ""
    error: str = ""
    elapsed_s: float = 0.0  # time the server spent on the call, injected latency included


ToolEvent = ToolCall | ToolResult


# --- tools registry: KV bucket "tools", key <namespace>.<tool> ----------------------------


class ToolSpec(Wire):
    """A served tool as the registry lists it; re-written by its servers as a heartbeat.

    ``parameters`` is the JSON schema of the arguments object (an OpenAI function's
    ``parameters``). Built-ins have namespace ``builtin`` and are named bare in a job spec
    (``search``); a tenant's tool is named ``<tenant>.<tool>``.
    """

    name: str
    namespace: str
    description: str = ""
    parameters: dict = {}
    announced_at: float = 0.0

    @property
    def qualified(self) -> str:
        return f"{self.namespace}.{self.name}"

    def function_schema(self, name: str | None = None) -> dict:
        """The OpenAI / Hermes function schema (``apply_chat_template(tools=[...])``)."""
        return {"type": "function", "function": {
            "name": name or self.name, "description": self.description, "parameters": self.parameters,
        }}


class RewardItem(Wire):
    problem: dict
    completion: str


class RewardRequest(Event, tag="reward.request"):
    job: str
    task: str
    items: list[RewardItem]
    dataset: str = ""  # the job's dataset, for tasks built from user data (a file id, or a platform path)
    corpus: str = ""
    tenant: str = ""  # the job's tenant: whose uploaded files the ids above name


class RewardResult(Event, tag="reward.result"):
    rewards: list[float] = []
    error: str = ""


RewardEvent = RewardRequest | RewardResult


# --- METRICS stream: marlaas.span.<job> ---------------------------------------------------


class Span(Event, tag="span"):
    """A timed phase of one job in one service (``generate``, ``reward``, ``train``, ``commit``)."""

    job: str
    service: str
    phase: str
    version: int
    start: float
    end: float
    attrs: dict[str, float | str] = {}


MetricEvent = Span

# --- KV records: buckets "versions" and "jobs" --------------------------------------------


class CommittedVersion(Wire):
    """The ``versions`` entry of a job: changed only by compare-and-set from the revision read."""

    job: str
    version: int
    adapter: Blob
    optimizer: Blob | None = None
    batch_id: str = ""
    metrics: dict[str, float] = {}  # of the batch that made this version
    committed_at: float = 0.0


class EvalPoint(Wire):
    version: int
    score: float


class JobRecord(Wire):
    """The ``jobs`` entry of a job: its spec, state and the figures users see."""

    spec: JobSpec
    state: JobState = JobState.QUEUED
    reason: str = ""
    version: int = -1
    rewards: list[float] = []  # mean reward of the batch trained at each version, in order
    metrics: dict[str, list[float]] = {}  # per version, like rewards: the agent's tool/* and episode/* figures
    evals: list[EvalPoint] = []  # held-out scores, by version
    pinned: list[int] = []  # versions the tenant pinned: garbage collection keeps their adapters
    warnings: dict[str, str] = {}  # what the job depends on and misbehaves now, by what it is
    kv_cache_bytes: int = 0
    admitted_at: float = 0.0
    first_commit_at: float = 0.0  # version 1, i.e. the first trained update
    last_commit_at: float = 0.0
    finished_at: float = 0.0
    followed_by: str = ""  # the job ``spec.then`` started when this one completed

    @property
    def steps_done(self) -> int:
        return max(self.version, 0)

    @property
    def ttfs_s(self) -> float | None:
        """Time to first step: submission -> first committed update."""
        return self.first_commit_at - self.spec.submitted_at if self.first_commit_at else None

    @property
    def tpts_s(self) -> float | None:
        """Time per training step, averaged over the steps after the first."""
        if self.version < 2:
            return None
        return (self.last_commit_at - self.first_commit_at) / (self.version - 1)


# --- encoding -----------------------------------------------------------------------------

T = TypeVar("T")
_encoder = msgspec.json.Encoder()


def encode(event: msgspec.Struct) -> bytes:
    """Serialize any wire struct to JSON bytes."""
    return _encoder.encode(event)


class Codec(Generic[T]):
    """A typed decoder for one stream's union, built once."""

    def __init__(self, name: str, type_: type[T]) -> None:
        self.name = name
        self._decoder = msgspec.json.Decoder(type_)

    def decode(self, data: bytes) -> T:
        """Decode ``data``; raise :class:`EventDecodeError` naming the stream on bad bytes."""
        try:
            return self._decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise EventDecodeError(
                f"malformed {self.name} event ({len(data)} bytes): {exc}"
            ) from exc


JOB = Codec("job", JobEvent)
POLICY = Codec("policy", PolicyEvent)
TRAJECTORY = Codec("trajectory", TrajectoryEvent)
TOOL = Codec("tool", ToolEvent)
REWARD = Codec("reward", RewardEvent)
METRIC = Codec("metric", MetricEvent)
BATCH = Codec("trajectory batch", TrajectoryBatch)
COMMITTED = Codec("committed version", CommittedVersion)
JOB_RECORD = Codec("job record", JobRecord)
