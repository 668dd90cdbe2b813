"""Typed configuration: defaults <- TOML file <- ``MARLAAS_*`` env vars <- CLI flags.

Validated once at the edge (``load_config``) with errors that name the field, then
passed down explicitly. Config structs forbid unknown fields so a typo fails loudly.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

OPERATOR_TOKEN_FILE = "operator.token"  # under <home>/run: the operator's token for /metrics and the schema


class ConfigError(ValueError):
    """A config value is missing, misspelled or of the wrong type."""


class Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of config sections."""


class RolloutConfig(Section):
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE on CPU (whole GiB)
    gpu_memory_utilization: float = 0.8
    max_loras: int = 16  # adapters resident in one engine batch (as many as jobs sampled at once)
    # the largest rank a job or Tinker model may ask for (32: the Tinker SDK's and cookbook's
    # default). vLLM's own CPU kernels pad every adapter to it (16 instead of 8 cost a rank-8 job
    # ~46 %); marlaas's fused CPU kernels (the default) do not: rank-8 jobs within noise of each
    # other at 8, 16 and 32 (benchmarks/engine_lora.py, docs/configuration.md)
    max_lora_rank: int = 32
    # prompt and sample together; the cookbook's multi-turn recipes pass 512. Unset, it is lowered to
    # the base model's own context where that is shorter (load_config: the char base's is 512)
    max_model_len: int = 1024
    # how prompts and tool observations are written: "chat" with the base model's chat template
    # (tools listed by it, each observation in its tool turn; an error for a model without one),
    # "bare" as plain text and bare <tool_call> / <tool_response> tags (models without a template),
    # "auto" the template when the model has one, else bare
    prompt_format: Literal["auto", "chat", "bare"] = "chat"
    # sequences in one engine step (0 = vLLM's default, 128): enough for every concurrent job's
    # episodes, since on a small model a step's fixed cost is most of it (benchmarks/engine_lora.py)
    max_num_seqs: Annotated[int, msgspec.Meta(ge=0)] = 1024
    # the order the engine serves waiting requests in: "fifo" (first come, first served) or
    # "frontier" (the batches, and groups, closest to complete first: services/rollout/frontier.py)
    dispatch: Literal["fifo", "frontier"] = "fifo"
    # under "fifo": the engine serves waiting requests by tenants' weighted shares (start-time fair
    # queueing, services/rollout/fair_share.py; `marlaas tenant set NAME --weight W`), each tenant's
    # own in arrival order; false = one first-come-first-served queue for every tenant
    fair_share: bool = True
    # with fair_share: while two or more tenants are busy, the engine runs at most this many of their
    # requests, divided by weight; a tenant over its part is preempted (its latest requests aborted in
    # vLLM and run again, same seed) and the rest wait before vLLM (services/rollout/fair_share.py:
    # RunningShares). A tenant alone is not bounded. vLLM runs every request it takes in one batch and
    # a step's time grows with it, so this bounds any tenant's step time whatever the others' volume;
    # set it near the engine's throughput knee (this 2-core CPU's: ~128 sequences; an accelerator's:
    # hundreds). 0 = no bound: volume decides (docs/tenants.md)
    fair_share_running: Annotated[int, msgspec.Meta(ge=0)] = 128
    dtype: str = "float32"
    concurrency: int = 16  # jobs sampled at once by one replica
    # Tinker asample requests in one replica's engine at once (each up to 64 sequences), and of one
    # tenant: the rest wait in the queue, tenants taking turns, so the jobs keep generating
    tinker_sample_concurrency: Annotated[int, msgspec.Meta(ge=1)] = 4
    tinker_sample_per_tenant: Annotated[int, msgspec.Meta(ge=1)] = 2
    # batch every job's requests in the engine together (multi-LoRA); false = one job's requests at
    # a time, the paper's "without multi-LoRA" ablation
    multi_lora: bool = True
    # on CPU, where vLLM runs the model: "uni" in the engine core process itself; "mp" (vLLM's own
    # default on CPU) in a worker process fed through a shared-memory queue whose readers spin for
    # a second after every message, which burns about a second core on a 2-core machine
    # (benchmarks/engine_executor.py)
    cpu_executor: Literal["uni", "mp"] = "uni"
    cpu_threads: Annotated[int, msgspec.Meta(ge=0)] = 1  # uni: the CPU engine's torch threads (0 = torch's default)
    # on CPU, vLLM's LoRA ops ("vllm": a copy of the adapter per token) or marlaas's (libs/marlaas/
    # vllm_plugin; "grouped": one matmul per adapter in the batch; "fused": a layer's every slice and
    # adapter in two matmuls), benchmarks/engine_lora.py --kernels fused,grouped,vllm
    cpu_lora_kernels: Literal["fused", "grouped", "vllm"] = "fused"
    cpu_threads_bind: str = "auto"  # mp: VLLM_CPU_OMP_THREADS_BIND, the cores the worker's threads use
    block_size: int = 0  # KV-cache block (tokens); 0 = the backend's (128 on CPU). Only full blocks are
    # prefix-cached: a smaller block lets short multi-turn episodes re-enter from the cache
    tool_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0  # a tool call's reply deadline
    # a reward request's reply deadline; a request unanswered by then is retried (the env may be restarting)
    reward_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 60.0
    # an announcement held by a replica that died is sampled again after this long (JetStream's
    # AckWait); a live replica sends a heartbeat every 5 s while it samples, so it never loses one
    ack_wait_s: Annotated[float, msgspec.Meta(ge=15)] = 20.0
    # a job's tool or reward that has answered none of its requests for this long fails the job
    # with that reason (a warning in its status names it from the first unanswered request)
    give_up_s: Annotated[float, msgspec.Meta(gt=0)] = 300.0


class TrainerConfig(Section):
    device: Literal["cpu", "cuda", "npu"] = "cpu"
    # jobs whose adapter and optimizer stay in the trainer's memory between steps (a cold job is
    # loaded from the store): at most hot_adapters, and no more than fit in hot_memory_gib
    # (weights, gradients and AdamW's two moments of each adapter)
    hot_adapters: Annotated[int, msgspec.Meta(ge=1)] = 256
    hot_memory_gib: Annotated[float, msgspec.Meta(gt=0)] = 4.0
    micro_batch_tokens: Annotated[int, msgspec.Meta(ge=1)] = 2048  # padded tokens per forward/backward
    # 0 = auto: on cpu, all cores but one (the engine's) under the async schedule, all cores under
    # sync and sequential, whose train steps never run beside generation (policy.torch_threads)
    torch_threads: int = 0
    # chaos runs only (libs/marlaas/bench/chaos.py): SIGKILL itself with this probability right
    # after writing an adapter (not committed) and right after committing (not announced)
    fault_crash_p: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.0
    # a trajectory batch held by a trainer that died is delivered again after this long (JetStream's
    # AckWait); a live trainer sends a heartbeat every 5 s while it trains, so it never loses one
    ack_wait_s: Annotated[float, msgspec.Meta(ge=15)] = 20.0
    # true: trajectory batches are taken in tenant turns by weight (the tenant with the least
    # trainer time for its weight first; marlaas.platform.tenant_turns), and a paused tenant's are
    # left queued; false: one first-come-first-served queue for every tenant (the FIFO baseline)
    fair_share: bool = True
    # a batch sampled by the version it trains whose engine-vs-trainer logprob gap (mean |log p|
    # difference a token) is past this is not trained: its job fails, or on a platform fault the
    # base is reloaded (services/trainer/gap_watch.py); 0 = 1e-3 for a float32 engine beside a CPU
    # trainer, else 0.1 (half precision, or a trainer on an accelerator); inf = never acted on
    max_logprob_gap: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    # the shared base's weights compared with their digest at load this often (and after each
    # job's first step); a changed base is reloaded and an operator alert raised (0 = no schedule)
    base_check_every_s: Annotated[float, msgspec.Meta(ge=0)] = 600.0


class ManagerConfig(Section):
    kv_budget_gib: float = 1.0  # admission: estimated KV-cache bytes of running jobs must fit
    # async: each job advances on its own events (the design); sync: rounds where every running job
    # samples, a global barrier, then every job trains; sequential: one job at a time
    schedule: Literal["async", "sync", "sequential"] = "async"
    # kv: admit in submission order while the running jobs' KV-cache footprints fit kv_budget_gib;
    # adaptive: also admit one job at a time only while the engine and the trainers have idle time
    # and no running job's time per step exceeds target_tpts_s (services/manager/adaptive.py)
    admission: Literal["kv", "adaptive"] = "kv"
    target_tpts_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0  # adaptive: 0 = no bound on TPTS
    target_engine_busy: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.9  # adaptive: busy enough
    target_trainer_busy: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.9  # adaptive: per trainer replica
    # garbage collection keeps the adapters of a job's last N committed versions (and pinned ones)
    gc_keep_last: Annotated[int, msgspec.Meta(ge=1)] = 3
    # a tenant's finished jobs kept, the newest; an older one is deleted whole as `marlaas delete` does
    max_finished_jobs: Annotated[int, msgspec.Meta(ge=1)] = 200
    # live Tinker sessions a tenant may hold at once (each is a record; its models count against max_jobs)
    max_tinker_sessions: Annotated[int, msgspec.Meta(ge=1)] = 32


class EnvConfig(Section):
    """The env service's built-in tools (``search``, ``calculator``, ``python``) and rewards;
    the ``python_*`` settings also configure the ``sandbox`` service, which serves ``python``.

    ``tool_latency_s`` injects latency for benchmarks: it maps a tool name (bare for a
    built-in, e.g. ``"search"``) to a fixed delay in seconds (``2.0``) or to ``[low, high]``,
    a delay drawn uniformly from that range for every call. The delay is an ``asyncio.sleep``
    before the tool runs: it never holds up calls to other tools.

    ``judge_*`` configure the built-in ``judge`` reward (a job opts in with ``reward =
    "judge"``): an LLM behind an OpenAI-compatible server says whether each final answer
    matches the reference (see ``services/env/judge.py``).
    """

    tool_latency_s: dict[str, float | list[float]] = {}
    # wall clock (CPU seconds likewise); under rollout.tool_timeout_s, so a killed run is still reported
    python_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 5.0
    python_memory_mb: Annotated[int, msgspec.Meta(ge=64)] = 512  # a run's memory (cgroup) and address space
    # how the python tool isolates a run: "bwrap" (bubblewrap: namespaces, its own uid, a cgroup;
    # without a working bwrap env does not serve `python`, and submitting a job naming it fails) or
    # "none" (no namespaces, the operator's explicit choice: env logs a warning at start)
    python_isolation: Literal["bwrap", "none"] = "bwrap"
    # which process runs the python tool: "sandbox" (its own service, services/sandbox, whose
    # environment and broker user hold no platform secret; the embedded stack and compose start
    # it) or "env" (env itself, which holds the services' password and the store's keys)
    python_tool: Literal["sandbox", "env"] = "sandbox"
    # python runs at once on one replica (the sandbox service, or env): each may hold python_memory_mb;
    # past the cap a call waits its turn, tenants served in turn (services/env/tools/sandbox_turns.py)
    python_max_runs: Annotated[int, msgspec.Meta(ge=1)] = 8
    python_max_runs_per_tenant: Annotated[int, msgspec.Meta(ge=1)] = 4  # of those, one tenant's at most
    # how long a call waits for a run slot before it is answered "busy" (its code not run); with
    # python_timeout_s, under rollout.tool_timeout_s, so the answer still reaches rollout in time
    python_queue_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 4.0
    search_corpus: str = ""  # a JSONL file of {"id", "title"?, "text"}; "" = the shipped corpus
    search_top_k: Annotated[int, msgspec.Meta(ge=1, le=20)] = 3
    search_cached_indexes: Annotated[int, msgspec.Meta(ge=1)] = 4  # jobs' corpora kept indexed in memory
    judge_url: str = ""  # an OpenAI-compatible base URL, e.g. "http://127.0.0.1:8000/v1"; "" = no judge
    judge_model: str = ""  # the model name the judge server serves
    judge_api: Literal["chat", "completions"] = "chat"  # completions for a model without a chat template
    judge_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0  # one verdict's deadline
    judge_concurrency: Annotated[int, msgspec.Meta(ge=1)] = 16  # verdicts in flight per reward request
    judge_max_tokens: Annotated[int, msgspec.Meta(ge=1)] = 16  # room for the verdict (more for a thinking judge)
    judge_structured_verdict: bool = False  # vLLM judges only: constrain the reply to "yes" / "no"

    def __post_init__(self) -> None:
        for name, delay in self.tool_latency_s.items():
            bounds = delay if isinstance(delay, list) else [delay, delay]
            if len(bounds) != 2 or not 0 <= bounds[0] <= bounds[1]:
                raise ValueError(
                    f"env.tool_latency_s[{name!r}] = {delay!r}: give seconds >= 0, or [low, high] "
                    "with 0 <= low <= high"
                )


class GatewayConfig(Section):
    """The tenants' HTTP API (``services/gateway``): where it listens and what it accepts."""

    host: str = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 8470  # 0 = any free port (tests)
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 1 << 20  # a job spec is a few hundred bytes
    max_file_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 64 << 20  # one uploaded data file (POST /v1/files)
    # a tenant's uploaded files at once: bounds its share of the disk
    max_files: Annotated[int, msgspec.Meta(ge=1)] = 64
    # one line of an upload: all of a line the gateway holds while checking it (the rest streams to disk)
    max_line_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 1 << 20
    max_uploads_per_tenant: Annotated[int, msgspec.Meta(ge=1)] = 2  # uploads one tenant sends at once, per replica
    # open event streams (GET /v1/jobs/{id}/events), per replica: each holds two JetStream consumers,
    # and the broker's are shared by every tenant and service (~1,000 in all)
    max_streams_per_tenant: Annotated[int, msgspec.Meta(ge=1)] = 16
    max_streams: Annotated[int, msgspec.Meta(ge=1)] = 256
    # operator only: a job sent over HTTP may name server paths under this directory as its data
    # (dataset, corpus, eval_dataset) instead of uploaded files; "" = never (tenants upload their data)
    allow_server_paths_under: str = ""
    # the operator's bearer token for /metrics and the API schema (MARLAAS_OPERATOR_TOKEN);
    # "" = read it from operator_token_file, which "" makes <home>/run/operator.token (`marlaas up` writes it)
    operator_token: str = ""
    operator_token_file: str = ""


class Config(Section):
    """The whole stack's configuration."""

    home: str = "~/.marlaas"
    # "" = start the embedded nats-server; a cluster's servers comma-separated (nats://u:p@h:1,nats://u:p@h:2)
    nats_url: str = ""
    # each JetStream stream and KV bucket is created with this many copies: 3 on a three-node
    # cluster (`marlaas up --nats-cluster 3` sets it), 1 on a single server
    nats_replicas: Annotated[int, msgspec.Meta(ge=1, le=5)] = 1
    store_url: str = ""  # "" = file://<home>/store
    # "" = the built-in chat base (libs/marlaas/basemodel/chat); "builtin:char" = the character-level
    # one (with rollout.prompt_format = "bare"); else a local Hugging Face model directory
    base_model: str = ""
    log_format: Literal["console", "json"] = "console"
    log_level: str = "info"
    # JetStream drops a repeated Nats-Msg-Id within this window; exactly-once does not rest on
    # it (rollout records what it sampled, the trainer commits by compare-and-set)
    duplicate_window_s: Annotated[float, msgspec.Meta(ge=0.1)] = 300.0
    # every service warns, with the stack, when its event loop is held longer than this (one
    # callback that never yields stops every tenant the service serves)
    loop_block_warn_s: Annotated[float, msgspec.Meta(gt=0)] = 2.0
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    manager: ManagerConfig = msgspec.field(default_factory=ManagerConfig)
    env: EnvConfig = msgspec.field(default_factory=EnvConfig)
    gateway: GatewayConfig = msgspec.field(default_factory=GatewayConfig)

    def __post_init__(self) -> None:
        if self.base_model == "builtin:char" and self.rollout.prompt_format == "chat":
            raise ValueError("base_model 'builtin:char' has no chat template: set rollout.prompt_format = \"bare\" "
                             "with it (or \"auto\")")

    @property
    def home_dir(self) -> Path:
        return Path(self.home).expanduser().resolve()

    @property
    def resolved_store_url(self) -> str:
        return self.store_url or f"file://{self.home_dir / 'store'}"

    @property
    def operator_token_path(self) -> Path:
        """The file the gateway reads the operator's token from when ``gateway.operator_token`` is empty."""
        if self.gateway.operator_token_file:
            return Path(self.gateway.operator_token_file).expanduser()
        return self.home_dir / "run" / OPERATOR_TOKEN_FILE

    @property
    def base_model_dir(self) -> Path:
        from marlaas.basemodel import BUILTIN, builtin_model_dir, char_model_dir

        if self.base_model in BUILTIN:
            return char_model_dir() if BUILTIN[self.base_model] == "char" else builtin_model_dir()
        if self.base_model.startswith("builtin:"):
            raise ConfigError(f"base_model: {self.base_model!r} is not a built-in model; "
                              f"use one of {', '.join(BUILTIN)}, \"\" (the chat base) or a local directory")
        if self.base_model:
            path = Path(self.base_model).expanduser()
            if not (path / "config.json").is_file():
                raise ConfigError(
                    f"base_model: {path} is not a Hugging Face model directory (no config.json); "
                    "give a local directory saved with save_pretrained"
                )
            return path.resolve()
        return builtin_model_dir()


_ENV = {
    "MARLAAS_HOME": "home",
    "MARLAAS_NATS_URL": "nats_url",
    "MARLAAS_NATS_REPLICAS": "nats_replicas",
    "MARLAAS_STORE_URL": "store_url",
    "MARLAAS_BASE_MODEL": "base_model",
    "MARLAAS_LOG_FORMAT": "log_format",
    "MARLAAS_LOG_LEVEL": "log_level",
    "MARLAAS_DEVICE": "trainer.device",
    "MARLAAS_SCHEDULE": "manager.schedule",
    "MARLAAS_OPERATOR_TOKEN": "gateway.operator_token",
}


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for name in parents:
        tree = tree.setdefault(name, {})
    tree[leaf] = value


def load_config(
    path: str | os.PathLike | None = None, overrides: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
) -> Config:
    """Merge file, env and ``overrides`` (dotted keys, e.g. ``"manager.schedule"``) and validate."""
    env = os.environ if env is None else env
    tree: dict[str, Any] = {}
    path = path or env.get("MARLAAS_CONFIG")
    if path:
        try:
            tree = tomllib.loads(Path(path).read_text())
        except FileNotFoundError as exc:
            raise ConfigError(f"config file {path} does not exist") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    for var, dotted in _ENV.items():
        if env.get(var):
            _set_dotted(tree, dotted, env[var])
    for dotted, value in (overrides or {}).items():
        if value is not None:
            _set_dotted(tree, dotted, value)
    try:
        config = msgspec.convert(tree, Config, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid config: {exc}") from exc
    if "max_model_len" not in (tree.get("rollout") or {}):  # the default, within what the base can take
        context = model_context(config)
        if context and context < config.rollout.max_model_len:
            config = msgspec.structs.replace(config, rollout=msgspec.structs.replace(config.rollout,
                                                                                     max_model_len=context))
    return config


def model_context(config: Config) -> int | None:
    """The base model's own context (``max_position_embeddings`` in its config.json), if it says."""
    try:
        model = json.loads((config.base_model_dir / "config.json").read_text())
    except (ConfigError, OSError, ValueError):
        return None  # a bad base_model is reported where it is used
    context = model.get("max_position_embeddings") if isinstance(model, dict) else None
    return context if isinstance(context, int) and context > 0 else None


def dump_config(config: Config) -> bytes:
    """The config as JSON, for handing to child processes."""
    return msgspec.json.encode(config)


def read_config_json(data: bytes) -> Config:
    return msgspec.json.decode(data, type=Config)
