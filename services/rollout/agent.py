"""Multi-turn tool use: run one episode against the shared engine, calling tools over NATS.

Each episode is its own task. A turn is one engine request with the exact ids so far
(``TokensPrompt``; the prefix cache makes re-entry cheap) that stops at the closing call
tag. The call is parsed from the decoded sampled ids, sent to ``marlaas.tool.<ns>.<tool>``
(request/reply), and the result is tokenized and appended as an observation. While one
episode waits on a tool, the engine keeps generating every other episode of every job.

Nothing a tool or the model does raises out of an episode: a timeout, a tool error, an
unknown tool, a call that is not JSON (or too long, too deeply nested, with a number no
parser takes) or a reply that is not a tool result becomes an observation the model reads
(see :func:`marlaas.tools.protocol.parse_call` for the edge cases). A result is cut to the
task's ``max_observation_tokens`` by characters before it is tokenized, and tokenized in a
worker thread: a tool that sends megabytes never stalls other episodes. An episode ends when
the model answers (no call), runs out of its turn budget, reaches its task's call limit, or
would overflow the context. The model's turn is decoded and its call parsed in a worker
thread under ``read_deadline_s``: should a turn ever take longer to read, that episode is cut
(``read_timeout``) and every other episode goes on (parsing is linear, so this is a fence, not
a path taken).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog

from marlaas.platform.events import TOOL, EventDecodeError, ToolCall, ToolResult, ToolSpec, encode
from marlaas.tools.protocol import (
    CALL_CLOSE,
    RESPONSE_CLOSE,
    RESPONSE_OPEN,
    TRUNCATED,
    CallError,
    ParsedCall,
    cut_result,
    escape_result,
    parse_call,
)
from marlaas.tools.registry import qualify, tool_subject
from services.rollout.engine import PolicyEngine
from services.rollout.episode import Episode
from services.rollout.utilization import Utilization

log = structlog.get_logger("rollout")

# (subject, request bytes, timeout) -> reply bytes; raises TimeoutError when nobody answers in time
Request = Callable[[str, bytes, float], Awaitable[bytes]]


class ConversationFormat:
    """How a job's prompt and each tool observation become token ids for this base model.

    ``prompt_format`` (``rollout.prompt_format``): ``"chat"`` renders with the model's chat
    template (the tools described with ``apply_chat_template(tools=...)``, the observation
    wrapped in the template's tool turn); ``"bare"`` writes plain text and the bare tags a
    model without a template was pretrained on (the character-level base); ``"auto"`` picks
    the template when the tokenizer has one.

    Text from outside the model (a prompt, a conversation's messages, a tool's result) is
    tokenized with special tokens split, so it can never forge a special token, and with the
    tool tags escaped (:func:`escape_result`): the tags are *non-special* added tokens (as in
    Qwen3), which ``split_special_tokens`` does not split, so a prompt holding
    ``<tool_call>`` would otherwise put the tag's id in the model's context.
    """

    def __init__(self, tokenizer, prompt_format: str = "auto") -> None:
        self.tokenizer = tokenizer
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if prompt_format == "chat" and not has_template:
            raise ValueError("rollout.prompt_format = 'chat' but the base model has no chat template: give it "
                             "one (chat_template.jinja) or set rollout.prompt_format = 'bare'")
        if prompt_format not in ("auto", "chat", "bare"):
            raise ValueError(f"rollout.prompt_format must be 'auto', 'chat' or 'bare', not {prompt_format!r}")
        self.chat = prompt_format == "chat" or (prompt_format == "auto" and has_template)
        if self.chat:
            self.obs_head, self.obs_tail = self._template_observation()
        else:
            self.obs_head, self.obs_tail = RESPONSE_OPEN, RESPONSE_CLOSE

    def text_ids(self, text: str) -> list[int]:
        """Ids of untrusted text: special-token names and tool tags in it stay plain characters."""
        return self.tokenizer(escape_result(text), add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def markup_ids(self, text: str) -> list[int]:
        """Ids of the format's own markup (special tokens allowed)."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt_ids(self, prompt: str | None, tools: list[ToolSpec], *, system: str | None = None,
                   messages: list[dict] | None = None) -> list[int]:
        """The ids of an episode's prompt: one user turn (``prompt``) or a conversation
        (``messages``, ``{role, content}`` each, ending with a user turn; a leading system message
        takes the place of ``system``), the tools' schemas, then the assistant's turn opening.

        Bare: the system prompt and each message's content, one per line, then ``prompt``."""
        if messages is None:
            messages = [{"role": "user", "content": prompt or ""}]
        elif prompt is not None:
            raise ValueError("give a prompt or messages, not both")
        if system and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": system}, *messages]
        contents = [m["content"] for m in messages]
        if not self.chat:
            return self.text_ids("\n".join(contents))
        schemas = [t.function_schema(tool_name(t, tools)) for t in tools]
        rendered = self.tokenizer.apply_chat_template(
            [{"role": m["role"], "content": "\x00"} for m in messages], tools=schemas or None,
            add_generation_prompt=True, tokenize=False)
        markup = rendered.split("\x00")  # one placeholder per untrusted content
        if len(markup) != len(contents) + 1:
            raise ValueError(f"the chat template wrote {len(markup) - 1} of {len(contents)} messages' contents")
        ids = self.markup_ids(markup[0])
        for content, after in zip(contents, markup[1:]):
            # BPE merges across the end of a content ("city." + "\n\n# Tools" -> ".\n\n"): the markup
            # up to its next special token is tokenized with the content, as the whole text would be
            cut = min((at for token in self.tokenizer.all_special_tokens if (at := after.find(token)) >= 0),
                      default=len(after))
            ids += self.tokenizer(escape_result(content) + after[:cut], add_special_tokens=False,
                                  split_special_tokens=True)["input_ids"]
            ids += self.markup_ids(after[cut:])
        return ids

    def _content_ids(self, content: str, after: str) -> list[int]:
        """An untrusted content and the markup after it: the content escaped (no forged special
        token or tool tag) and tokenized with the markup up to its next special token (BPE merges
        across that boundary as in the whole text), then the rest of the markup."""
        cut = min((at for token in self.tokenizer.all_special_tokens if (at := after.find(token)) >= 0),
                  default=len(after))
        ids = self.tokenizer(escape_result(content) + after[:cut], add_special_tokens=False,
                             split_special_tokens=True)["input_ids"]
        return ids + self.markup_ids(after[cut:])

    def conversation_ids(self, messages: list[dict], tools: list[ToolSpec], *,
                         system: str | None = None) -> tuple[list[int], list[int]]:
        """A whole conversation (the ``sft`` task's rows: transformers' chat format, assistant
        ``tool_calls`` and ``tool`` results included) as ids, and a loss mask over them: 1 on the
        assistant's tokens (its text and its calls, each turn up to and including its end-of-turn
        token, as the model writes them), 0 on everything else. The tools are described in the
        system turn as in an episode's prompt (:meth:`prompt_ids`)."""
        if not self.chat:
            raise ValueError("supervised conversations need the base model's chat template "
                             "(rollout.prompt_format = 'chat' or 'auto' with a template)")
        if system and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": system}, *messages]
        end = self.tokenizer.eos_token
        schemas = [t.function_schema(tool_name(t, tools)) for t in tools]
        placeholders = [{**{k: v for k, v in m.items() if k in ("role", "tool_calls")}, "content": "\x00"}
                        for m in messages]
        rendered = self.tokenizer.apply_chat_template(placeholders, tools=schemas or None, tokenize=False)
        markup = rendered.split("\x00")
        if len(markup) != len(messages) + 1:
            raise ValueError(f"the chat template wrote {len(markup) - 1} of {len(messages)} messages' contents")
        ids, mask = self.markup_ids(markup[0]), []
        mask = [0] * len(ids)
        for message, after in zip(messages, markup[1:]):
            content = message.get("content") or ""
            if message["role"] != "assistant":
                piece = self._content_ids(content, after)
                ids, mask = ids + piece, mask + [0] * len(piece)
                continue
            at = after.find(end)
            if at < 0:
                raise ValueError(f"the chat template does not end an assistant turn with {end!r}")
            turn = self._content_ids(content, after[:at + len(end)])  # the model's own: trained
            rest = self.markup_ids(after[at + len(end):])
            ids, mask = ids + turn + rest, mask + [1] * len(turn) + [0] * len(rest)
        return ids, mask

    def observation_ids(self, result: str, max_tokens: int) -> list[int]:
        """The observation after a call: the result, tags defused, cut to ``max_tokens`` with a marker.

        The text is cut by characters first (:func:`cut_result`), so the cost is bounded by
        ``max_tokens`` whatever the result's size."""
        result, cut = cut_result(result, max_tokens)
        body = self.text_ids(result)
        if cut or len(body) > max_tokens:
            marker = self.text_ids(TRUNCATED)
            body = body[: max(max_tokens - len(marker), 0)] + marker
        return self.markup_ids(self.obs_head) + body + self.markup_ids(self.obs_tail)

    def _template_observation(self) -> tuple[str, str]:
        """What the chat template writes between an assistant's call and the next assistant turn."""
        call = "<tool_call>\x01</tool_call>"
        before = [{"role": "user", "content": "u"}, {"role": "assistant", "content": call}]
        first = self.tokenizer.apply_chat_template(before, tokenize=False)
        full = self.tokenizer.apply_chat_template(before + [{"role": "tool", "content": "\x02"}],
                                                  add_generation_prompt=True, tokenize=False)
        start = first.index(call) + len(call)  # the model stops right after its call: the rest is ours
        head, tail = full[start:].split("\x02")
        return head, tail


def tool_name(spec: ToolSpec, specs: list[ToolSpec]) -> str:
    """The name a model is shown for a tool: bare unless another of the job's tools shares it."""
    return spec.name if sum(s.name == spec.name for s in specs) == 1 else spec.qualified


@dataclass(frozen=True)
class EpisodeLimits:
    max_new_tokens: int  # per turn
    max_tool_calls: int
    max_observation_tokens: int
    max_total_tokens: int  # prompt + everything after it, within rollout.max_model_len
    tool_timeout_s: float
    read_deadline_s: float = 2.0  # decoding and parsing one turn (linear, well under a millisecond)


class ToolBox:
    """The tools one job may call (fixed when it was admitted), and how to call them."""

    def __init__(self, job: str, tools: list[str], request: Request, timeout_s: float,
                 utilization: Utilization | None = None, context: dict[str, str] | None = None) -> None:
        self.job = job
        self.context = context or {}
        self.utilization = utilization or Utilization()
        qualified = [qualify(name) for name in tools]
        bare = [q.partition(".")[2] for q in qualified]
        # the model may call a tool by its bare name when no other tool of the job shares it
        self.names = {q: q for q in qualified} | {b: q for b, q in zip(bare, qualified) if bare.count(b) == 1}
        self.request = request
        self.timeout_s = timeout_s

    async def call(self, call: ParsedCall) -> tuple[str, bool]:
        """The observation text of one call and whether it succeeded."""
        qualified = self.names.get(call.name)
        if qualified is None:
            known = ", ".join(sorted(set(self.names.values()))) or "none"
            return f"error: unknown tool {call.name!r}; tools you can call: {known}", False
        request = ToolCall(job=self.job, call_id=uuid.uuid4().hex, tool=qualified, arguments=call.arguments,
                           context=self.context)
        try:
            with self.utilization.tool_call():
                data = await self.request(tool_subject(qualified), encode(request), self.timeout_s)
        except TimeoutError:
            return f"error: tool {call.name!r} did not answer within {self.timeout_s:g}s", False
        try:
            result = TOOL.decode(data)
        except EventDecodeError:
            result = None
        if not isinstance(result, ToolResult):
            return f"error: tool {call.name!r} replied with something that is not a tool result", False
        if result.error:
            return f"error: {result.error}", False
        return result.output, True


async def run_episode(engine: PolicyEngine, fmt: ConversationFormat, prompt_ids: list[int], *,
                      tools: ToolBox, limits: EpisodeLimits, temperature: float, lora,
                      seed: Callable[[int], int], ignore_eos: bool = False,
                      priority: Callable[[], int] | None = None, tenant: str = "", rank: int = 1,
                      episode: Episode | None = None, stopped: Callable[[], bool] | None = None) -> Episode:
    """Sample one episode; ``seed(turn)`` gives each turn's sampling seed; ``ignore_eos``
    makes every turn run to its budget (fixed-length completions, for benchmarks); ``priority()``,
    when given, each turn's place in the engine's queue (frontier-group dispatch); ``tenant``, whose
    share of the engine each turn counts against (``rollout.fair_share``), and ``rank`` the job's
    priority within it (``fair_share.RANKS``).

    ``episode``: the caller's (empty) episode to fill, so that what it used is known even if this
    is cancelled half-way (metering). ``stopped()``: true once the job is cancelled or failed; the
    episode then starts no more turns (the one in the engine finishes) and ends as ``"stopped"``."""
    episode = episode if episode is not None else Episode(prompt_ids)
    while True:
        budget = min(limits.max_new_tokens, limits.max_total_tokens - len(episode) - 1)
        if budget <= 0:
            episode.end_reason = "context_full"
            return episode
        if stopped is not None and stopped():
            episode.end_reason = "stopped"
            return episode
        episode.in_engine = len(episode)  # charged as sent, even if the turn is cut off (its batch failed)
        turn = await engine.generate(episode.ids, max_tokens=budget, temperature=temperature, lora=lora,
                                     seed=seed(episode.turns),  # a single-turn task's text is never cut at a tag
                                     stop=[CALL_CLOSE] if limits.max_tool_calls else None,
                                     ignore_eos=ignore_eos, **({"tenant": tenant} if tenant else {}),
                                     **({"rank": rank} if rank != 1 else {}),
                                     **({"priority": priority()} if priority else {}))
        episode.in_engine = 0
        if episode.turns:
            episode.cached_tokens.append(turn.cached_tokens)
        episode.add_turn(turn.token_ids, turn.logprobs)
        wants_call = turn.finish_reason == "stop" and limits.max_tool_calls
        try:  # off the event loop and under a deadline: the text is the model's, hence untrusted
            call = await asyncio.wait_for(asyncio.to_thread(read_turn, fmt.tokenizer, turn.token_ids, tools.job),
                                          limits.read_deadline_s) if wants_call else None
        except TimeoutError:
            log.warning("reading a turn's tool call missed its deadline; the episode is cut", job=tools.job,
                        deadline_s=limits.read_deadline_s, turn_tokens=len(turn.token_ids))
            episode.end_reason = "read_timeout"
            return episode
        if call is None:
            episode.end_reason = "answer" if turn.finish_reason == "stop" else "length"
            return episode
        if episode.tool_calls >= limits.max_tool_calls:
            episode.end_reason = "max_tool_calls"
            return episode
        episode.tool_calls += 1
        started = time.monotonic()
        try:
            if isinstance(call, CallError):
                result, ok = f"error: {call.message}", False
            else:
                result, ok = await tools.call(call)
                if call.note:  # first, so that cutting a long result never hides it
                    result = f"{call.note}\n{result}"
        finally:  # metered even when the episode is cut off during the call
            episode.tool_wait_s += time.monotonic() - started
        episode.tool_successes += ok
        episode.tool_errors += not ok
        observation = await asyncio.to_thread(fmt.observation_ids, result, limits.max_observation_tokens)
        if len(episode) + len(observation) + 1 >= limits.max_total_tokens:
            episode.end_reason = "context_full"
            return episode
        episode.add_observation(observation)


def read_turn(tokenizer, token_ids: list[int], job: str) -> ParsedCall | CallError | None:
    """The call in one sampled turn, read from its decoded ids (never vLLM's ``.text``)."""
    return read_call(tokenizer.decode(token_ids, skip_special_tokens=True), job)


def read_call(text: str, job: str) -> ParsedCall | CallError | None:
    """:func:`parse_call`, and should it ever raise (it is written not to), the call becomes an
    error the model sees: one model output must never fail its job's batch."""
    try:
        return parse_call(text)
    except Exception as exc:  # noqa: BLE001 -- deliberately tolerated, and logged with the job
        log.error("the tool-call parser raised; the call is answered with an error", job=job,
                  error=repr(exc)[:300], turn_chars=len(text))
        return CallError(f"the tool call could not be read ({type(exc).__name__})")
