"""Job validation, as pure functions: from a submission and what the stack is, a job record or what to fix.

:func:`validate_submission` checks a submission in the order the costs grow, so an oversized or
mistyped one is refused before any costly step:

0. the data it and its follow-ups name, against its tenant's bounds (:func:`data_refusal`, which
   the manager applies before any link is checked: rows and bytes summed over the data fields and
   the ``then`` chain, from the files' records, not from the data);
1. the fields' bounds (:func:`field_problems`: every problem at once, and each text's length in
   characters, see ``sizing``);
2. the task over the job's data (read by the ``load_task`` it is given), and the held-out data;
3. tools and reward names (:func:`tool_problem`), the generation budget (:func:`generation_problem`);
4. the prompts' lengths in characters, then their tokens (the ``count_tokens`` it is given);
5. the KV-cache footprint against the whole budget (:func:`footprint_problem`).

Nothing here touches the bus or the store: the manager (``service.py``) passes in the facts of
the stack (:class:`StackFacts`), reads the data, counts tokens, and then checks what only the bus
can tell (tools and rewards served now, the tenant's quotas).
"""

from __future__ import annotations

import hashlib
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from marlaas.platform import api, limits
from marlaas.platform.events import PIPELINE_MODES, TRUNCATED_MODES, GrpoSettings, JobRecord, JobSpec
from marlaas.platform.tenants import TENANT_RE
from marlaas.tasks import TaskError
from marlaas.tasks.sft import steps_for_epochs
from marlaas.tools.registry import BUILTIN_REWARDS, ToolNameError, split_qualified
from services.manager.admission import job_footprint
from services.manager.sizing import longest_prompt_tokens, prompts_refusal, system_refusal

_SLUG = re.compile(r"[^a-z0-9]+")

DATA_FIELDS = ("dataset", "eval_dataset", "corpus")  # a submission's fields that name a data file
CountTokens = Callable[[list[str]], list[int]]  # texts -> each one's tokens
LoadTask = Callable[[str | None], object]  # a dataset reference -> the task over it (or TaskError)


@dataclass(frozen=True)
class StackFacts:
    """What validation needs to know of the stack: its config's bounds and the base model's facts."""

    max_model_len: int  # rollout.max_model_len: prompt and generation together, in tokens
    max_lora_rank: int  # rollout.max_lora_rank
    lora_targets: frozenset[str]  # the base model's linear layers (LoRA's possible targets)
    token_chars: int  # the longest vocabulary entry's characters (``sizing.max_token_chars``)
    kv_bytes_per_token: int  # ``admission.kv_bytes_per_token``
    kv_budget_bytes: int  # manager.kv_budget_gib, in bytes


def submission_chain(request: api.SubmitRequest) -> list[tuple[str, api.SubmitRequest]]:
    """The submission and each of its follow-ups, each with where it is (``""``, ``"then"``,
    ``"then.then"``, ...); :class:`api.SubmitError` for a chain too long or a follow-up malformed."""
    links, follow, where = [("", request)], request, "then"
    while (follow := api.follow_up(follow, where)) is not None:
        links.append((where, follow))
        where += ".then"
    return links


def data_refs(chain: list[tuple[str, api.SubmitRequest]]) -> list[tuple[str, str]]:
    """Each data file the chain's links name, as ``(field, reference)``: ``("then.dataset", "file-...")``.
    A file named twice is listed twice: each link reads its data again."""
    return [(f"{where}.{name}" if where else name, ref) for where, link in chain for name in DATA_FIELDS
            if (ref := getattr(link, name))]


@dataclass(frozen=True)
class DataSize:
    """One data file a submission names: where (``dataset``, ``then.corpus``, ...), the reference
    as given (a file id, or a path), and its records and bytes."""

    field: str
    ref: str
    rows: int
    bytes: int


def data_refusal(sizes: list[DataSize], tenant: str, max_rows: int, max_bytes: int) -> str:
    """Why the data a submission names is more than tenant ``tenant`` may submit at once ("" = it
    is not): its files' rows, or their bytes, summed over every data field of every link of the
    ``then`` chain, above ``max_rows`` (``max_dataset_rows``) or ``max_bytes`` (``max_dataset_bytes``).
    Checked from the files' records before any of the data is read: the manager reads and checks
    all of it before it answers."""
    rows, size = sum(s.rows for s in sizes), sum(s.bytes for s in sizes)
    if rows > max_rows:
        what, bound, flag = f"{rows:,} rows", f"max_dataset_rows = {max_rows:,}", "--max-dataset-rows"
        each = [f"{s.field} {s.ref} ({s.rows:,} rows)" for s in sizes]
    elif size > max_bytes:
        what, bound, flag = f"{size:,} bytes", f"max_dataset_bytes = {max_bytes:,}", "--max-dataset-bytes"
        each = [f"{s.field} {s.ref} ({s.bytes:,} bytes)" for s in sizes]
    else:
        return ""
    chained = any(s.field.startswith("then.") for s in sizes)
    again = " (each link of a `then` chain reads its data again)" if chained else ""
    fewer = ", or name it in fewer follow-ups" if chained else ""
    return (f"the data this submission names is {what}, above tenant {tenant}'s bound ({bound}): "
            f"{'; '.join(each)}{again}. Submit a smaller dataset (a sample of its rows){fewer}; or ask the "
            f"operator to raise the bound (`marlaas tenant set {tenant} {flag} N`)")


def field_problems(request: api.SubmitRequest, facts: StackFacts) -> list[str]:
    """Every problem with the submission's fields alone (no data read), in a fixed order."""
    grpo, lora = request.grpo, request.lora
    supervised = request.task == "sft"
    system_too_long = system_refusal(request.system, facts.max_model_len, facts.token_chars)
    unknown_targets = sorted(set(lora.target_modules) - facts.lora_targets)
    problems = [
        (bool(system_too_long), system_too_long),
        (len(request.idempotency_key) > api.MAX_IDEMPOTENCY_KEY_CHARS,
         f"idempotency_key must be at most {api.MAX_IDEMPOTENCY_KEY_CHARS} characters (send one per "
         "submission, e.g. a UUID)"),
        (len(request.name) > limits.MAX_NAME_CHARS, f"name must be at most {limits.MAX_NAME_CHARS} characters"),
        (not TENANT_RE.match(request.tenant), "tenant must be lowercase letters, digits and '-'"),
        (not 1 <= request.steps <= limits.MAX_STEPS, f"steps must be between 1 and {limits.MAX_STEPS}"),
        (not 0 <= request.seed <= limits.MAX_JOB_SEED,
         f"seed must be between 0 and {limits.MAX_JOB_SEED} (2**63 - 1)"),
        (not 1 <= grpo.prompts_per_step <= limits.MAX_PROMPTS_PER_STEP,
         f"grpo.prompts_per_step must be between 1 and {limits.MAX_PROMPTS_PER_STEP}"),
        (not supervised and not 2 <= grpo.group_size <= limits.MAX_GROUP_SIZE, f"grpo.group_size must be at "
         f"least 2 and at most {limits.MAX_GROUP_SIZE} (GRPO compares samples in a group)"),
        (supervised and not 1 <= request.sft.batch_size <= limits.MAX_PROMPTS_PER_STEP,
         f"sft.batch_size must be between 1 and {limits.MAX_PROMPTS_PER_STEP} (conversations a step)"),
        (supervised and not 0 <= request.sft.epochs <= limits.MAX_SFT_EPOCHS,
         f"sft.epochs must be between 0 and {limits.MAX_SFT_EPOCHS} (0: the job's steps as given)"),
        (supervised and (grpo.max_staleness or grpo.pipeline != "batch"),
         "an sft job trains the tenant's conversations, nothing is sampled: drop grpo.max_staleness and "
         "grpo.pipeline"),
        (supervised and bool(request.eval_every), "an sft job reports its training loss, it has no reward to "
         "evaluate with: drop eval_every (evaluate the adapter in an RL job started from it, init_from)"),
        (not limits.MIN_TEMPERATURE <= grpo.temperature <= limits.MAX_TEMPERATURE,
         f"grpo.temperature must be in [{limits.MIN_TEMPERATURE}, {limits.MAX_TEMPERATURE}] (sampling is "
         "random; the trainer scores the same tempered policy)"),
        (not 0 < grpo.learning_rate < 1, "grpo.learning_rate must be in (0, 1)"),
        (not 0 < grpo.clip_eps < 1, "grpo.clip_eps must be in (0, 1)"),
        (grpo.kl_coef < 0, "grpo.kl_coef must be >= 0"),
        (grpo.truncated not in TRUNCATED_MODES, f"grpo.truncated must be one of {', '.join(TRUNCATED_MODES)} "
         f"(what becomes of an episode cut off before it answered), not {grpo.truncated!r}"),
        (grpo.pipeline not in PIPELINE_MODES, f"grpo.pipeline must be one of {', '.join(PIPELINE_MODES)} ('groups': "
         f"each group is trained as soon as it is scored; 'batch': the whole batch at once), not {grpo.pipeline!r}"),
        (not 0 <= grpo.max_staleness <= limits.MAX_STALENESS,
         f"grpo.max_staleness must be between 0 and {limits.MAX_STALENESS} (0: every batch is sampled by the "
         "version it trains; k: by a version up to k behind it)"),
        (grpo.ignore_eos and grpo.truncated != "train", "grpo.ignore_eos makes every episode end by length "
         "(truncated): with it, grpo.truncated must be 'train'"),
        (not 1 <= lora.rank <= facts.max_lora_rank,
         f"lora.rank must be between 1 and {facts.max_lora_rank} (rollout.max_lora_rank)"),
        (grpo.max_new_tokens < 0, "grpo.max_new_tokens must be >= 0 (0 = the task's own budget); its "
         "upper bound is rollout.max_model_len less the prompt, checked with the task below"),
        (not 0 <= request.eval_every <= limits.MAX_STEPS,
         f"eval_every must be >= 0 and at most {limits.MAX_STEPS} (0 = no evaluation)"),
        (not 1 <= request.eval_problems <= limits.MAX_EVAL_PROBLEMS,
         f"eval_problems must be between 1 and {limits.MAX_EVAL_PROBLEMS}"),
        (bool(request.eval_dataset) and not request.eval_every,
         "eval_dataset is set but eval_every is 0: set eval_every = N to evaluate every N versions"),
        (not 1 <= lora.alpha <= limits.MAX_LORA_ALPHA, f"lora.alpha must be between 1 and {limits.MAX_LORA_ALPHA}"),
        (lora.dropout != 0, "lora.dropout must be 0 for RL jobs: dropout makes the trained policy "
         "differ from the one that sampled the batch (off-policy); drop lora.dropout"),
        (not lora.target_modules, "lora.target_modules must name at least one module"),
        (bool(unknown_targets),
         f"lora.target_modules {unknown_targets} are not linear "
         f"layers of the base model; choose from {sorted(facts.lora_targets)}"),
    ]
    return [message for bad, message in problems if bad]


def tool_problem(request: api.SubmitRequest, task, tools: tuple[str, ...]) -> str:
    """Why the job's tools or reward do not suit ``task`` ("" = they do): tools only for agentic
    tasks, each a valid name in ``builtin`` or the submitter's namespace, and a reward where the
    task has none of its own."""
    tenant = request.tenant
    if tools and task.kind == "single-turn":
        return (f"task {task.name!r} is single-turn: it cannot call tools; drop 'tools' "
                "or choose an agentic task (`marlaas tasks`)")
    if task.needs_tools and not tools:
        return (f"task {task.name!r} needs 'tools': the tools the model may call, at least one "
                f"(built-in ones by name, your own as '{tenant}.<name>')")
    if task.kind == "supervised" and request.reward:
        return f"task {task.name!r} trains on your conversations: it takes no reward; drop 'reward'"
    if not task.has_reward and not request.reward and task.kind != "supervised":
        return (f"task {task.name!r} needs 'reward': a built-in one "
                f"({', '.join(BUILTIN_REWARDS)}) or your own '{tenant}.<name>'")
    for name in (*tools, *([request.reward] if "." in request.reward else [])):
        try:
            namespace, _ = split_qualified(name)
        except ToolNameError as exc:
            return str(exc)
        if namespace not in ("builtin", tenant):
            return (f"{name!r} belongs to tenant {namespace!r}: a job may use only built-in "
                    f"tools and its own tenant's ({tenant}.<name>)")
    if request.reward and "." not in request.reward and request.reward not in BUILTIN_REWARDS:
        return (f"reward {request.reward!r}: name your reward function as "
                f"'{tenant}.<name>', or a built-in one ({', '.join(BUILTIN_REWARDS)}); "
                "the task's own reward needs no 'reward' field")
    return ""


def calls_problem(task, tools: tuple[str, ...], dataset: str | None) -> str:
    """Why an ``sft`` dataset's tool calls do not suit the job's tools ("" = they do): each call
    must name one of them as the model is shown it (bare, or qualified when two share a name)."""
    shown = {name.rpartition(".")[2] for name in tools} | set(tools)
    for line, name in task.called_tools():
        if name not in shown:
            known = ", ".join(sorted(shown)) or "none (add 'tools' to the job)"
            return (f"{dataset}:{line}: a call names tool {name!r}, which the job does not name in 'tools' "
                    f"(it names: {known}); add it to 'tools' or fix the row")
    return ""


def generation_problem(max_new_tokens: int, max_model_len: int) -> str:
    """Why ``max_new_tokens`` leaves no room for any prompt ("" = it leaves some)."""
    if max_new_tokens < max_model_len:
        return ""
    return (f"grpo.max_new_tokens ({max_new_tokens}) leaves no room for the prompt: it "
            f"exceeds rollout.max_model_len ({max_model_len}); lower max_new_tokens")


def kv_footprint(grpo: GrpoSettings, prompt_tokens: int, episode_tokens: int, kv_bytes_per_token: int) -> int:
    """The KV cache the job's rollout batches can hold at once (``admission.job_footprint``): one
    batch, or up to 1 + max_staleness batches (each of another version) at bounded staleness."""
    batch = job_footprint(grpo.prompts_per_step, grpo.group_size, prompt_tokens, episode_tokens, kv_bytes_per_token)
    return batch * (1 + max(grpo.max_staleness, 0))


def footprint_problem(footprint: int, budget_bytes: int) -> str:
    """Why a job of ``footprint`` bytes could never be admitted ("" = it fits the whole budget)."""
    if footprint <= budget_bytes:
        return ""
    return (f"the job's rollout needs ~{footprint / 2**20:.1f} MiB of KV cache, more than the "
            f"whole budget ({budget_bytes / 2**20:.1f} MiB, manager.kv_budget_gib): lower "
            "grpo.prompts_per_step, grpo.group_size, grpo.max_new_tokens or grpo.max_staleness")


def job_name(request: api.SubmitRequest) -> tuple[str, str]:
    """The job's display name (the task's, when it has none) and its slug for the job id."""
    name = request.name.strip() or request.task
    return name, _SLUG.sub("-", name.lower()).strip("-")[:40] or "job"


def job_id(tenant: str, slug: str, idempotency_key: str = "") -> str:
    """A new job's id: ``<tenant>.<slug>-<suffix>``, the suffix random, or with an idempotency key
    its hash (48 bits: the same key gives the same id, and so the same job; a tenant's keys never
    collide in practice)."""
    if not idempotency_key:
        return f"{tenant}.{slug}-{uuid.uuid4().hex[:6]}"
    digest = hashlib.sha256(f"{tenant}\n{idempotency_key}".encode()).hexdigest()[:12]
    return f"{tenant}.{slug}-{digest}"


def build_spec(request: api.SubmitRequest, grpo: GrpoSettings, tools: tuple[str, ...], now: float) -> JobSpec:
    """The job's spec: the submission with its generation budget and tools resolved."""
    name, slug = job_name(request)
    return JobSpec(id=job_id(request.tenant, slug, request.idempotency_key), tenant=request.tenant,
                   name=name, task=request.task, steps=request.steps, seed=request.seed,
                   dataset=request.dataset, corpus=request.corpus, tools=tools,
                   eval_every=request.eval_every, eval_problems=request.eval_problems,
                   eval_dataset=request.eval_dataset, reward=request.reward, system=request.system,
                   grpo=grpo, lora=request.lora, sft=request.sft, init_from=request.init_from,
                   then=msgspec.json.encode(request.then).decode() if request.then is not None else "",
                   submitted_at=now, priority=request.priority)


def _refuse(problem: str) -> None:
    if problem:
        raise api.SubmitError(problem)


def job_record(request: api.SubmitRequest, task, facts: StackFacts, count_tokens: CountTokens,
               now: float) -> JobRecord:
    """A queued job record for a submission whose fields passed and whose ``task`` is built, or
    :class:`api.SubmitError` with the first problem found (steps 3 to 5 of the module docstring)."""
    grpo = msgspec.structs.replace(request.grpo, max_new_tokens=request.grpo.max_new_tokens or task.max_new_tokens)
    tools = tuple(request.tools) if request.tools is not None else task.tools
    _refuse(tool_problem(request, task, tools))
    if task.kind == "supervised":
        return supervised_record(request, task, grpo, tools, facts, count_tokens, now)
    _refuse(generation_problem(grpo.max_new_tokens, facts.max_model_len))
    prompts = task.longest_prompts()
    _refuse(prompts_refusal(prompts, facts.max_model_len, facts.token_chars))
    prompt_tokens = longest_prompt_tokens(count_tokens, request.system, prompts, facts.max_model_len,
                                          grpo.max_new_tokens)
    episode_tokens = min(task.max_episode_tokens(grpo.max_new_tokens), facts.max_model_len - prompt_tokens)
    footprint = kv_footprint(grpo, prompt_tokens, episode_tokens, facts.kv_bytes_per_token)
    _refuse(footprint_problem(footprint, facts.kv_budget_bytes))
    return JobRecord(spec=build_spec(request, grpo, tools, now), kv_cache_bytes=footprint)


def supervised_record(request: api.SubmitRequest, task, grpo: GrpoSettings, tools: tuple[str, ...],
                      facts: StackFacts, count_tokens: CountTokens, now: float) -> JobRecord:
    """The queued record of an ``sft`` job: its calls name its tools, each conversation fits the
    context (characters first, then tokens), and ``sft.epochs`` (when set) gives its steps. It
    generates nothing: no KV cache to reserve."""
    _refuse(calls_problem(task, tools, request.dataset))
    texts = task.longest_prompts()
    _refuse(prompts_refusal(texts, facts.max_model_len, facts.token_chars))
    for row, tokens in zip(task.rows, count_tokens(texts)):
        if tokens > facts.max_model_len:
            _refuse(f"{request.dataset}:{row['_line']}: the conversation is {tokens} tokens, more than "
                    f"rollout.max_model_len ({facts.max_model_len}); shorten it or split it in two")
    steps = request.steps
    if request.sft.epochs:
        steps = min(steps_for_epochs(len(task.rows), request.sft.epochs, request.sft.batch_size), limits.MAX_STEPS)
    grpo = msgspec.structs.replace(grpo, group_size=1, prompts_per_step=request.sft.batch_size)
    spec = msgspec.structs.replace(build_spec(request, grpo, tools, now), steps=steps)
    return JobRecord(spec=spec, kv_cache_bytes=0)


def validate_submission(request: api.SubmitRequest, facts: StackFacts, load_task: LoadTask,
                        count_tokens: CountTokens, now: float) -> JobRecord:
    """A queued job record from a submission, or :class:`api.SubmitError` saying what to fix (all
    the fields' problems at once, or the first later one). ``load_task(dataset)`` builds the task
    over a dataset reference (raising :class:`TaskError`); ``count_tokens`` counts texts' tokens."""
    if problems := field_problems(request, facts):
        raise api.SubmitError("; ".join(problems))
    try:
        task = load_task(request.dataset)
    except TaskError as exc:
        raise api.SubmitError(str(exc)) from exc
    if request.eval_dataset:
        try:
            load_task(request.eval_dataset)
        except TaskError as exc:
            raise api.SubmitError(f"eval_dataset: {exc}") from exc
    return job_record(request, task, facts, count_tokens, now)
