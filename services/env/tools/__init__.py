"""The built-in tools (namespace ``builtin``): ``calculator``, ``search``, ``python``.

Each is a small pure core (``calculator.py``, ``search.py``, ``python_sandbox.py``) wrapped
as a :func:`marlaas.tools.tool`, so it is served by the same shell as a tenant's tools.
:func:`serve_builtin_tools` subscribes env's on a bus and keeps them announced. ``search``
reads the configured corpus, or the job's own when its call's context names one
(``{"corpus": path}``, set by the job's task). ``python`` is served by the ``sandbox`` service
(``services/sandbox``, through :func:`checked_python_tool`) unless ``env.python_tool = "env"``;
its runs take turns per tenant, by the tenants' weights where env serves it (``sandbox_turns.py``),
so whoever serves it serves it on a :class:`TenantTaggingBus`, which tells the tool each call's tenant.
``search`` (and its BM25 library) is imported only when used, so the sandbox starts light.
"""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from marlaas.platform.bus import Bus
from marlaas.platform.config import Config, EnvConfig
from marlaas.platform.files import DataFiles, FileMissing, is_file_id
from marlaas.platform.tenants import tenant_weights
from marlaas.tools import BUILTIN, DEFAULT_CORPUS, ServedTools, Tool, ToolError, serve_tools, tool
from services.env.tools.calculator import CalculatorError, calculate, format_value
from services.env.tools.latency import InjectedLatency
from services.env.tools.python_sandbox import (
    Isolation,
    SandboxError,
    SandboxLimits,
    SandboxUnavailable,
    check_isolation,
    run_python,
)
from services.env.tools.sandbox_turns import CALLING_TENANT, RunCaps, RunTurns, TenantTaggingBus, WeightsReader

if TYPE_CHECKING:
    from services.env.tools.search import CorpusIndexes, SearchIndex

log = structlog.get_logger("env.tools")


def calculator_tool() -> Tool:
    @tool(name="calculator")
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression exactly (integers stay exact).

        Args:
            expression: numbers with + - * / // % ** and parentheses, e.g. "(3 + 4) * 2**10".
        """
        try:
            return format_value(calculate(expression))
        except CalculatorError as exc:
            raise ToolError(str(exc)) from None

    return calculator


def search_tool(index: SearchIndex, default_k: int, job_corpora: CorpusIndexes | None = None,
                files: DataFiles | None = None) -> Tool:
    """``search`` over ``index``, or over the job's corpus (from ``job_corpora``) when a call's
    context names one: a path (the platform's own jobs), or a tenant's uploaded file
    (``{"corpus": "file-...", "tenant": ...}``, fetched from the store through ``files`` into
    this env's own cache, so env need not share a disk with rollout)."""
    from services.env.tools.search import MAX_K, CorpusError, CorpusIndexes, render_results

    job_corpora = CorpusIndexes(cache_dir=None) if job_corpora is None else job_corpora

    @tool(name="search", context=True)
    def search(query: str, k: int = default_k, context: dict[str, str] | None = None) -> str:
        """Search the knowledge base; returns the best-matching passages, best first.

        Args:
            query: keywords to look for.
            k: how many passages to return (1-20).
        """
        if not query.strip():
            raise ToolError("query is empty: give keywords to search for")
        if not 1 <= k <= MAX_K:
            raise ToolError(f"k must be between 1 and {MAX_K}, not {k}")
        corpus, tenant = (context or {}).get("corpus"), (context or {}).get("tenant", "")
        try:
            if is_file_id(corpus):
                if files is None or not tenant:
                    raise CorpusError(f"{corpus} is an uploaded file, and this env reads no uploads")
                corpus = files.local_path(tenant, corpus)
            chosen = job_corpora.get(corpus) if corpus else index
        except (CorpusError, FileMissing) as exc:
            raise ToolError(f"the job's corpus cannot be searched: {exc}") from None
        return render_results(query, chosen.search(query, k))

    return search


def python_tool(limits: SandboxLimits, isolation: Isolation = "bwrap", turns: RunTurns | None = None) -> Tool:
    """The python tool; its runs take ``turns`` (default caps if None) by the tenant in
    :data:`CALLING_TENANT` (set when served on a :class:`TenantTaggingBus`)."""
    turns = RunTurns() if turns is None else turns

    @tool(name="python")
    async def python(code: str) -> str:
        """Run Python 3 code in a sandbox (no network, limited time and memory) and return its
        stdout, stderr and exit status. Print what you want to see.

        Args:
            code: a complete Python program.
        """
        try:
            async with turns.slot(CALLING_TENANT.get()):
                run = await run_python(code, limits, isolation)
        except SandboxError as exc:
            raise ToolError(str(exc)) from None
        return run.render()

    return python


def sandbox_limits(env: EnvConfig) -> SandboxLimits:
    return SandboxLimits(timeout_s=env.python_timeout_s, memory_mb=env.python_memory_mb)


def run_turns(env: EnvConfig, read_weights: WeightsReader | None = None) -> RunTurns:
    """The run slots of this replica's python tool, as ``env.python_max_runs*`` configure them,
    shared by the weights ``read_weights`` reads (None: every tenant weighs 1)."""
    return RunTurns(RunCaps(max_runs=env.python_max_runs, max_runs_per_tenant=env.python_max_runs_per_tenant,
                            queue_timeout_s=env.python_queue_timeout_s), read_weights)


async def checked_python_tool(env: EnvConfig, read_weights: WeightsReader | None = None) -> Tool | None:
    """The python tool, or None (logged as an error) where its configured isolation is unavailable:
    env then serves its other tools, and a job naming ``python`` is refused at submit. Its runs are
    shared by the tenants' weights that ``read_weights`` reads (None: every tenant weighs 1)."""
    if env.python_isolation == "none":
        log.warning("python_tool_unisolated", isolation="none",
                    detail="env.python_isolation = \"none\": model code runs without namespaces, as the "
                           "host sees it (rlimits and a temp dir only)")
        return python_tool(sandbox_limits(env), "none", run_turns(env, read_weights))
    try:
        await check_isolation(env.python_isolation)
    except SandboxUnavailable as exc:
        log.error("python_tool_not_served", isolation=env.python_isolation, reason=str(exc))
        return None
    return python_tool(sandbox_limits(env), env.python_isolation, run_turns(env, read_weights))


def search_cache_dir(config: Config) -> Path:
    return config.home_dir / "cache" / "search"


async def builtin_tools(config: Config, files: DataFiles | None = None,
                        read_weights: WeightsReader | None = None) -> list[Tool]:
    """Env's built-in tools as configured by ``config.env`` (``python`` only with
    ``env.python_tool = "env"``; else the sandbox service serves it); the search index is built
    (or loaded) in a thread, so a large corpus does not stall the event loop. ``files``: where
    jobs' uploaded corpora are read from; ``read_weights``: the tenants' weights, which share
    ``python``'s runs (None: every tenant weighs 1)."""
    from services.env.tools.search import CorpusIndexes, SearchIndex

    corpus = Path(config.env.search_corpus).expanduser() if config.env.search_corpus else DEFAULT_CORPUS
    index = await asyncio.to_thread(SearchIndex.open, corpus, search_cache_dir(config))
    job_corpora = CorpusIndexes(search_cache_dir(config), config.env.search_cached_indexes)
    python = await checked_python_tool(config.env, read_weights) if config.env.python_tool == "env" else None
    return [calculator_tool(), search_tool(index, config.env.search_top_k, job_corpora, files)] + (
        [python] if python is not None else [])


async def serve_builtin_tools(bus: Bus, config: Config, files: DataFiles | None = None) -> ServedTools:
    """Serve the built-ins on ``marlaas.tool.builtin.<name>`` with the configured injected latency
    (``python``'s runs shared by the tenants' weights, read on ``bus``)."""
    latency = InjectedLatency(config.env.tool_latency_s)
    tools = await builtin_tools(config, files, functools.partial(tenant_weights, bus))
    return await serve_tools(TenantTaggingBus(bus), tools, BUILTIN, delay=latency or None)
