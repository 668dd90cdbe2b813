# over 500 lines: tools and rewards share one serving shell (decode, call, answer, reconnect)
"""The tools SDK: serve a tenant's tools and rewards to marlaas from a plain Python file.

    from marlaas.tools import serve, tool

    @tool
    def weather(city: str) -> str:
        \"\"\"Today's weather in a city.\"\"\"
        return f"{city}: sunny"

    if __name__ == "__main__":
        serve(weather, tenant="acme")

``@tool`` derives the tool's JSON schema from the signature (str, int, float, bool,
``list[...]``, defaults make a parameter optional) and its description from the docstring
(a Google-style ``Args:`` section describes the parameters). Arguments are validated and
converted by msgspec before the function runs. ``@tool(context=True)`` also passes the
call's context (``ToolCall.context``: what the job's task attaches to every call, e.g. its
corpus; the model cannot set it) as the keyword ``context: dict[str, str]``, which is left
out of the schema. ``@reward("name")`` serves a
``(problem: dict, completion: str) -> float`` on ``marlaas.reward.<tenant>.<name>``.

The env service serves its built-in tools through the same shell (:func:`serve_tools`), so a
built-in and a tenant's tool answer calls identically: a bad call never crashes the server,
it becomes a ``ToolResult`` whose ``error`` says what was wrong.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import numbers
import os
import re
import signal
import time
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import msgspec
import nats
import structlog

from marlaas.platform.bus import Bus, connect_options
from marlaas.platform.events import (
    REWARD,
    TOOL,
    EventDecodeError,
    RewardRequest,
    RewardResult,
    ToolCall,
    ToolResult,
    ToolSpec,
    encode,
)
from marlaas.platform.nats_access import inbox_prefix, redact_url, url_with_credentials
from marlaas.tools.registry import (
    BUILTIN,
    check_namespace,
    check_tool_name,
    keep_announced,
    reward_subject,
    stop_heartbeat,
    tool_subject,
)

log = structlog.get_logger("marlaas.tools")

MAX_OUTPUT_CHARS = 100_000  # keeps a reply well within a tenant's message (limits.MAX_TENANT_MESSAGE_BYTES)
Delay = Callable[[str], float]  # qualified tool name -> seconds to wait before the call


class ToolError(Exception):
    """An error a tool reports to the model as it is (no exception type, no traceback)."""


# --- @tool --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tool:
    """A function served as a tool: its name, description, argument schema and validator."""

    name: str
    description: str
    parameters: dict  # JSON schema of the arguments object
    function: Callable
    arguments_type: type[msgspec.Struct]
    takes_context: bool = False  # the function gets the call's context as ``context=``

    def __call__(self, *args, **kwargs):
        return self.function(*args, **kwargs)

    def spec(self, namespace: str) -> ToolSpec:
        """The registry entry of this tool served under ``namespace``."""
        return ToolSpec(name=self.name, namespace=namespace, description=self.description,
                        parameters=self.parameters)

    def parse_arguments(self, arguments: str) -> dict:
        """The keyword arguments in ``arguments`` (JSON text), validated; :class:`ToolError` if not."""
        try:
            parsed = msgspec.json.decode(arguments.strip() or "{}", type=self.arguments_type,
                                         strict=False)
        except msgspec.ValidationError as exc:
            raise ToolError(f"invalid arguments for {self.name}: {exc}") from None
        except msgspec.DecodeError as exc:
            raise ToolError(f"arguments for {self.name} are not valid JSON: {exc}") from None
        return {field: getattr(parsed, field) for field in self.arguments_type.__struct_fields__}

    async def call(self, arguments: str, context: dict[str, str] | None = None) -> str:
        """Validate ``arguments``, run the function (a sync one in a thread) and return its text;
        ``context`` reaches only a tool made with ``context=True``."""
        kwargs = self.parse_arguments(arguments)
        if self.takes_context:
            kwargs["context"] = dict(context or {})
        if inspect.iscoroutinefunction(self.function):
            value = await self.function(**kwargs)
        else:
            value = await asyncio.to_thread(self.function, **kwargs)
            if inspect.isawaitable(value):
                value = await value
        return tool_output(value)


def tool(function: Callable | None = None, *, name: str | None = None,
         description: str | None = None, context: bool = False):
    """Make ``function`` a tool; usable as ``@tool`` or ``@tool(name=..., description=...)``.

    Every parameter needs a type annotation; the docstring (or ``description``) tells the
    model what the tool does. With ``context=True`` the function must take a keyword
    ``context`` (not shown to the model): the call's ``ToolCall.context``.
    """

    def wrap(fn: Callable) -> Tool:
        tool_name = check_tool_name(name or fn.__name__)
        summary, param_docs = _parse_docstring(inspect.getdoc(fn) or "")
        if context and "context" not in inspect.signature(fn).parameters:
            raise TypeError(f"tool {tool_name}: context=True needs a parameter named 'context'")
        arguments_type = _arguments_struct(fn, tool_name, param_docs, skip=("context",) if context else ())
        return Tool(name=tool_name, description=description or summary,
                    parameters=_object_schema(arguments_type), function=fn,
                    arguments_type=arguments_type, takes_context=context)

    return wrap(function) if function is not None else wrap


_SECTION = re.compile(r"^(Args|Arguments|Parameters|Returns|Raises|Yields|Examples?):\s*$")
_PARAM = re.compile(r"^\s*+(\w++)\s*+(\([^)]*+\))?\s*+:\s*+(.*)$")  # possessive: no backtracking


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """The text before the first Google-style section, and the ``Args:`` descriptions."""
    summary: list[str] = []
    params: dict[str, str] = {}
    section, current = None, None
    for line in doc.splitlines():
        if heading := _SECTION.match(line):
            section = heading.group(1)
        elif section is None:
            summary.append(line)
        elif section in ("Args", "Arguments", "Parameters") and line.strip():
            found = _PARAM.match(line)
            if found and line.startswith(" ") and not line.startswith(" " * 8):
                current = found.group(1)
                params[current] = found.group(3).strip()
            elif current:  # a continuation line
                params[current] = f"{params[current]} {line.strip()}".strip()
    return "\n".join(summary).strip(), params


def _arguments_struct(fn: Callable, tool_name: str, docs: dict[str, str],
                      skip: tuple[str, ...] = ()) -> type[msgspec.Struct]:
    hints = typing.get_type_hints(fn, include_extras=True)
    fields = []
    for param in inspect.signature(fn).parameters.values():
        if param.name in skip:
            continue
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
            raise TypeError(f"tool {tool_name}: parameter {param.name!r} must be a plain named one")
        if param.name not in hints:
            raise TypeError(f"tool {tool_name}: parameter {param.name!r} needs a type annotation "
                            "(str, int, float, bool, list[...], ...)")
        annotation = hints[param.name]
        if param.name in docs:
            annotation = typing.Annotated[annotation, msgspec.Meta(description=docs[param.name])]
        fields.append((param.name, annotation) if param.default is param.empty
                      else (param.name, annotation, param.default))
    return msgspec.defstruct(f"{tool_name}_arguments", fields, kw_only=True,
                             forbid_unknown_fields=True)


def _object_schema(arguments_type: type[msgspec.Struct]) -> dict:
    """msgspec's schema of the arguments struct, inlined at the top level (no ``$ref``)."""
    schema = msgspec.json.schema(arguments_type)
    definitions = dict(schema.get("$defs", {}))
    top = dict(definitions.pop(arguments_type.__name__))
    top.pop("title", None)
    if definitions:  # nested structs stay referenced as "#/$defs/<name>", now under the top
        top["$defs"] = definitions
    return top


def tool_output(value: object) -> str:
    """A tool's return value as text: str as is; dict, list and numbers as JSON; else an error."""
    if isinstance(value, str):
        text = value
    elif isinstance(value, (dict, list, tuple, int, float)):
        try:
            text = msgspec.json.encode(value).decode()
        except (TypeError, ValueError) as exc:
            raise ToolError(f"tool returned a {type(value).__name__} that is not JSON: {exc}") from None
    else:
        raise ToolError(f"tool returned {type(value).__name__}, not text")
    if len(text) > MAX_OUTPUT_CHARS:
        text = f"{text[:MAX_OUTPUT_CHARS]}\n[... truncated {len(text) - MAX_OUTPUT_CHARS} characters]"
    return text


# --- the serving shell ----------------------------------------------------------------------


def _call_id_of(data: bytes) -> str:
    """The ``call_id`` of an undecodable request, when it has one, so the error can be matched."""
    try:
        found = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return ""
    call_id = found.get("call_id") if isinstance(found, dict) else None
    return call_id if isinstance(call_id, str) else ""


async def answer_tool_call(tool: Tool, namespace: str, data: bytes,
                           delay: Delay | None = None) -> ToolResult:
    """Answer one request to ``tool``; every fault becomes a ``ToolResult`` with ``error`` set."""
    started = time.monotonic()
    qualified = f"{namespace}.{tool.name}"
    try:
        call = TOOL.decode(data)
    except EventDecodeError as exc:
        return ToolResult(call_id=_call_id_of(data), error=str(exc))
    if not isinstance(call, ToolCall):
        return ToolResult(call_id=call.call_id, error=f"expected a tool.call, got {type(call).__name__}")
    if call.tool not in ("", tool.name, qualified):
        return ToolResult(call_id=call.call_id, error=f"a call to {call.tool!r} reached {qualified}")
    if delay is not None and (seconds := delay(qualified)) > 0:
        await asyncio.sleep(seconds)  # injected latency (benchmarks); other calls run meanwhile
    output, error = "", ""
    try:
        output = await tool.call(call.arguments, call.context)
    except ToolError as exc:
        error = str(exc)
    except Exception as exc:  # a tool's own bug must not take the server down
        log.warning("tool raised", tool=qualified, job=call.job, call_id=call.call_id, exc_info=True)
        error = f"{qualified} failed: {type(exc).__name__}: {exc}"
    return ToolResult(call_id=call.call_id, output=output, error=error,
                      elapsed_s=time.monotonic() - started)


@dataclass
class ServedTools:
    """Tools being served on a bus; :meth:`stop` unsubscribes them and ends their heartbeat."""

    subscriptions: list
    heartbeat: asyncio.Task

    async def stop(self) -> None:
        await stop_heartbeat(self.heartbeat)
        for sub in self.subscriptions:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()


async def serve_tools(bus: Bus, tools: Iterable[Tool], namespace: str, *,
                      delay: Delay | None = None, heartbeat_s: float | None = None,
                      tenant: bool = False) -> ServedTools:
    """Subscribe each tool on ``marlaas.tool.<namespace>.<name>`` (queue group ``tool-<namespace>``),
    then announce them in the registry and keep heart-beating them (``tenant``: ``bus`` is a
    connection without JetStream, a tenant's or the sandbox service's, which announces through
    the platform's registrar)."""
    check_namespace(namespace)
    tools = list(tools)
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ValueError(f"two tools share a name in {names}")
    subscriptions = []
    for served in tools:
        async def answer(data: bytes, served: Tool = served) -> bytes:
            return encode(await answer_tool_call(served, namespace, data, delay))

        subject = tool_subject(f"{namespace}.{served.name}")
        subscriptions.append(await bus.serve(subject, f"tool-{namespace}", answer))
    await bus.nc.flush()  # subscribed at the server before anyone reads the announcement
    try:
        heartbeat = await keep_announced(bus, [t.spec(namespace) for t in tools], heartbeat_s,
                                         tenant=tenant)
    except BaseException:
        for sub in subscriptions:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        raise
    return ServedTools(subscriptions, heartbeat)


# --- @reward --------------------------------------------------------------------------------


@dataclass(frozen=True)
class RewardFunction:
    """A tenant's reward: ``(problem, completion) -> float`` in [0, 1]."""

    name: str
    function: Callable[[dict, str], float]

    def __call__(self, problem: dict, completion: str):
        return self.function(problem, completion)

    async def score(self, request: RewardRequest) -> list[float]:
        """One reward per item; raises on a function error or a value outside [0, 1]."""
        if inspect.iscoroutinefunction(self.function):
            values = [await self.function(item.problem, item.completion) for item in request.items]
        else:
            values = await asyncio.to_thread(
                lambda: [self.function(item.problem, item.completion) for item in request.items]
            )
        rewards = []
        for value in values:
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"returned {type(value).__name__}, not a number")
            if not (math.isfinite(value) and 0.0 <= value <= 1.0):
                raise ValueError(f"returned {value!r}, not a finite reward in [0, 1]")
            rewards.append(float(value))
        return rewards


def reward(name: str | Callable | None = None):
    """Make a function a reward, served as ``<tenant>.<name>``: ``@reward("name")`` or ``@reward``.

    The contract: ``fn(problem: dict, completion: str) -> float``, sync or async.

    - ``problem``: the task's record for the prompt (for a dataset task, the dataset row with
      its answer and any other fields).
    - ``completion``: the model's final turn as text (its answer; never a tool's output or the
      chat template's markup).
    - Returns a number in [0, 1]. A bool, NaN, infinity or anything outside [0, 1], or an
      exception, fails the job with that message (the server keeps serving other jobs).
    - Each batch is one request; a reply slower than ``rollout.reward_timeout_s`` is asked
      again, the job's status warns from the first unanswered request, and after
      ``rollout.give_up_s`` with no answer the job fails, naming the reward.
    """
    if callable(name):
        return RewardFunction(check_tool_name(name.__name__), name)

    def wrap(fn: Callable) -> RewardFunction:
        return RewardFunction(check_tool_name(name or fn.__name__), fn)

    return wrap


def decode_reward_request(data: bytes) -> RewardRequest | RewardResult:
    """The request in ``data``, or the error result to send back when it is not one."""
    try:
        request = REWARD.decode(data)
    except EventDecodeError as exc:
        return RewardResult(error=str(exc))
    if not isinstance(request, RewardRequest):
        return RewardResult(error=f"expected a reward.request, got {type(request).__name__}")
    return request


async def answer_reward_request(function: RewardFunction, data: bytes) -> RewardResult:
    """Answer one reward request; every fault becomes a ``RewardResult`` with ``error`` set."""
    request = decode_reward_request(data)
    if isinstance(request, RewardResult):
        return request
    try:
        return RewardResult(rewards=await function.score(request))
    except Exception as exc:  # the tenant's code: report it to the job, keep serving
        log.warning("reward failed", reward=function.name, job=request.job, exc_info=True)
        return RewardResult(error=f"reward {function.name!r} failed: {type(exc).__name__}: {exc}")


# --- serve ----------------------------------------------------------------------------------


def broker_url(tenant: str, nats_url: str | None = None, token: str | None = None) -> str:
    """The URL, with credentials, that ``tenant``'s process connects to the broker with.

    ``token`` (else ``$MARLAAS_TOKEN``) is the tenant's API token, which is also its NATS
    password (the user is the tenant). ``nats_url`` defaults to ``$MARLAAS_NATS_URL``, else the
    broker of a running ``marlaas up``; there, tenant ``default`` finds its token in
    ``<home>/run/default-tenant.token`` and any other tenant must give its own. Without a
    token, a URL given explicitly is used with whatever credentials it carries.
    """
    from marlaas.platform.tenants import tenant_of_token

    token = token or os.environ.get("MARLAAS_TOKEN") or None
    if not nats_url:
        from marlaas.platform.config import load_config
        from marlaas.sdk.discovery import default_tenant_token, running_nats_url

        config = load_config()
        nats_url = running_nats_url(config)  # MARLAAS_NATS_URL, else the running `marlaas up`
        if token is None and not config.nats_url:  # the embedded broker: never its services' URL
            token = default_tenant_token(config) if tenant == "default" else None
            if token is None:
                raise ValueError(f"serving as tenant {tenant!r} needs its token: pass token= or set "
                                 f"MARLAAS_TOKEN (`marlaas tenant add {tenant}` prints one)")
    if token is None:
        return nats_url
    if tenant_of_token(token) != tenant:
        raise ValueError(f"that token is not tenant {tenant!r}'s (tokens look like mlt_{tenant}_...)")
    return url_with_credentials(nats_url, tenant, token)


REFUSED_GIVE_UP_S = 15.0  # a broker reload can refuse a known user for a moment; a revoked one, forever


async def _connect(url: str, tenant: str, stop: asyncio.Event) -> Bus:
    """Connect as ``tenant`` (replies on its own inbox prefix); set ``stop`` once the broker has
    refused the credentials for :data:`REFUSED_GIVE_UP_S` (a revoked token)."""
    refused_since: list[float] = []
    refused_at_first = asyncio.get_running_loop().create_future()

    async def on_error(exc: Exception) -> None:
        # permission violations reach the client only here (a refused publish just times out)
        if "authorization violation" not in str(exc).lower():
            log.warning("nats error", error=str(exc), tenant=tenant)
            return
        if not refused_at_first.done():
            refused_at_first.set_result(str(exc))
        refused_since[:] = refused_since or [time.monotonic()]
        if time.monotonic() - refused_since[0] > REFUSED_GIVE_UP_S and not stop.is_set():
            log.error("the broker refuses this tenant's token (revoked?); stopping", tenant=tenant)
            stop.set()

    async def on_reconnected() -> None:
        refused_since.clear()

    connecting = asyncio.ensure_future(nats.connect(
        **connect_options(url), name=f"tools-{tenant}", inbox_prefix=inbox_prefix(tenant),
        error_cb=on_error, reconnected_cb=on_reconnected,
    ))
    await asyncio.wait([connecting, refused_at_first], timeout=10.0,
                       return_when=asyncio.FIRST_COMPLETED)
    if not connecting.done() or connecting.exception() is not None:
        connecting.cancel()  # nats-py would retry a refused login for ever
        why = refused_at_first.result() if refused_at_first.done() else "nothing answers"
        raise ConnectionError(f"cannot connect to NATS at {redact_url(url)} as {tenant!r}: {why} "
                              "(is marlaas up? is the token right?)")
    return Bus(connecting.result())


async def serve_async(*functions: Tool | RewardFunction | Callable, tenant: str,
                      nats_url: str | None = None, stop: asyncio.Event | None = None,
                      token: str | None = None) -> None:
    """Serve tools and rewards as ``tenant`` until ``stop`` is set (by default: SIGINT / SIGTERM).

    A plain function is served as ``tool(function)``. In-flight calls finish before it returns.
    ``token`` and ``nats_url``: see :func:`broker_url`.
    """
    check_namespace(tenant)
    if tenant == BUILTIN:
        raise ValueError(f"{BUILTIN!r} is the env service's namespace; serve as your tenant")
    tools = [f if isinstance(f, Tool) else tool(f) for f in functions
             if not isinstance(f, RewardFunction)]
    rewards = [f for f in functions if isinstance(f, RewardFunction)]
    if not tools and not rewards:
        raise ValueError("serve() needs at least one @tool or @reward function")
    url = broker_url(tenant, nats_url, token)
    loop = asyncio.get_running_loop()
    signals = []
    if stop is None:
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, stop.set)
                signals.append(sig)
    try:
        await _serve_until(stop, url, tenant, tools, rewards)
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


async def _serve_until(stop: asyncio.Event, url: str, tenant: str, tools: list[Tool],
                       rewards: list[RewardFunction]) -> None:
    bus = await _connect(url, tenant, stop)
    served, reward_subscriptions = None, []
    try:
        for function in rewards:
            async def answer(data: bytes, function: RewardFunction = function) -> bytes:
                return encode(await answer_reward_request(function, data))

            subject = reward_subject(f"{tenant}.{function.name}")
            reward_subscriptions.append(await bus.serve(subject, f"reward-{tenant}", answer))
        if tools:  # last: once a tool is announced, everything here is served
            served = await serve_tools(bus, tools, tenant, tenant=True)
        await bus.nc.flush()
        log.info("serving", tenant=tenant, tools=[t.name for t in tools],
                 rewards=[r.name for r in rewards], nats=redact_url(url))
        await stop.wait()
    finally:
        if served is not None:
            await served.stop()
        for sub in reward_subscriptions:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        await bus.close()  # waits for in-flight calls to be answered
        log.info("stopped", tenant=tenant)


def serve(*functions: Tool | RewardFunction | Callable, tenant: str,
          nats_url: str | None = None, token: str | None = None) -> None:
    """Serve tools and rewards as ``tenant`` until SIGINT / SIGTERM (blocking).

    ``token`` defaults to ``MARLAAS_TOKEN``; ``nats_url`` to ``MARLAAS_NATS_URL``, else the
    broker of a running ``marlaas up`` (see :func:`broker_url`).
    """
    from marlaas.platform.logs import setup_logging

    setup_logging(f"tools-{tenant}")
    asyncio.run(serve_async(*functions, tenant=tenant, nats_url=nats_url, token=token))
