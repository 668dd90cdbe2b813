"""Sandbox shell: serve the built-in ``python`` tool on ``marlaas.tool.builtin.python`` (queue
group ``tool-builtin``), apart from every other service.

The code a model writes runs here, under bubblewrap (``services/env/tools/python_sandbox.py``),
built exactly as env would build it (:func:`services.env.tools.checked_python_tool`). What this
process adds is defence in depth: it connects as the broker's ``sandbox`` user, which may only
serve this subject, announce it and hear its own inbox (no JetStream, no other service's subject),
and its environment holds no platform secret (the launcher gives it only its own broker URL; in
compose its container has no S3 keys and not the services' password). It opens no object store
and creates no stream. So code that escaped bubblewrap into this process still reaches nothing.

It cannot write the ``tools`` bucket: it announces through env's registrar
(``marlaas.registry.builtin.announce``), retrying until env answers, and is ready once announced.
"""

from __future__ import annotations

import asyncio

import structlog

from marlaas.platform.runtime import Runtime
from marlaas.platform.tenants import SharesHeard
from marlaas.tools import BUILTIN, ServedTools, Tool, serve_tools
from services.env.tools import checked_python_tool
from services.env.tools.latency import InjectedLatency
from services.env.tools.sandbox_turns import TenantTaggingBus

log = structlog.get_logger("sandbox")
RETRY_S = 1.0  # between announcements while env's registrar does not answer yet


async def serve_announced(rt: Runtime, python: Tool) -> ServedTools | None:
    """Serve ``python`` and announce it through the registrar; retry until it answers (env may
    start after us). None if asked to stop first."""
    latency = InjectedLatency(rt.config.env.tool_latency_s)
    while not rt.stop.is_set():
        try:
            return await serve_tools(TenantTaggingBus(rt.bus), [python], BUILTIN, delay=latency or None,
                                     tenant=True)
        except TimeoutError as exc:  # tolerated: env's registrar is not up yet
            log.info("registrar not answering yet; retrying", error=str(exc))
            await asyncio.sleep(RETRY_S)
    return None


async def run(rt: Runtime) -> None:
    shares = SharesHeard()  # its runs are shared by the tenants' weights the manager broadcasts
    await shares.listen(rt.bus)
    python = await checked_python_tool(rt.config.env, shares.read)
    served = await serve_announced(rt, python) if python is not None else None
    rt.ready()
    log.info("ready", tools=[sub.subject for sub in served.subscriptions] if served else [],
             isolation=rt.config.env.python_isolation)
    try:
        await rt.stop.wait()
    finally:
        if served is not None:
            await served.stop()
