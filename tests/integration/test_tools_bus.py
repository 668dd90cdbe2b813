"""Tools over a real nats-server: a tenant's tool process served through the SDK (registry,
heartbeat expiry, restart, queue-group replicas, errors) and the env's built-in tools."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import msgspec
import pytest
from polling import eventually

from marlaas.platform.bus import Bus
from marlaas.platform.config import load_config
from marlaas.platform.events import REWARD, TOOL, RewardItem, RewardRequest, ToolCall, ToolResult, encode
from marlaas.tools import list_tools, read_tool, tool_subject
from marlaas.tools.registry import reward_subject, serve_registrar
from services.env.tools import serve_builtin_tools

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
TENANT_TOOLS = Path(__file__).with_name("tenant_tools.py")
WEATHER_EXAMPLE = ROOT / "examples" / "weather_tool.py"
TTL_S = 2.0  # the registry's TTL in these tests (30 s in production); heartbeats every TTL / 3


@pytest.fixture
async def tools_bus(bus):
    """The test bus with the tools registry's TTL shortened to ``TTL_S``, keeping the registry
    for tenants' tool processes as env does."""
    await bus.ensure_topology(bucket_ttl_s={"tools": TTL_S})
    await serve_registrar(bus)
    return bus


@pytest.fixture
def tool_process(nats_server, tmp_path):
    """Start tool-server scripts as separate processes (``MARLAAS_NATS_URL`` set); kill them at the end."""
    started: list[subprocess.Popen] = []

    def start(script: Path, *args: str) -> subprocess.Popen:
        env = {**os.environ, "MARLAAS_NATS_URL": nats_server.url, "MARLAAS_HOME": str(tmp_path / "home"),
               "PYTHONPATH": str(ROOT)}
        log_path = tmp_path / f"{script.stem}-{len(started)}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([sys.executable, str(script), *args], env=env, stdout=log,
                                    stderr=subprocess.STDOUT, cwd=ROOT)
        proc.log_path = log_path
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


async def call_tool(bus: Bus, name: str, arguments: str = "{}", call_id: str = "c1",
                    timeout_s: float = 5.0) -> ToolResult:
    data = encode(ToolCall(job="acme.j1", call_id=call_id, tool=name, arguments=arguments))
    result = TOOL.decode(await bus.request(tool_subject(name), data, timeout_s=timeout_s))
    assert isinstance(result, ToolResult) and result.call_id == call_id
    return result


async def start_and_wait(bus: Bus, tool_process, tenant: str = "acme") -> subprocess.Popen:
    """Start ``tenant_tools.py``; return once it serves (it logs "serving" after subscribing and
    announcing: another replica's registry entry would not tell)."""
    proc = tool_process(TENANT_TOOLS, tenant)
    await eventually(lambda: b"serving" in proc.log_path.read_bytes() or proc.poll() is not None,
                     30, "the tool process is serving")
    assert proc.poll() is None, proc.log_path.read_text()
    assert await read_tool(bus, f"{tenant}.whoami") is not None
    return proc


# --- a tenant's tool process ------------------------------------------------------------------


async def test_sdk_tool_announces_answers_expires_when_killed_and_comes_back(tools_bus, tool_process):
    bus = tools_bus
    proc = await start_and_wait(bus, tool_process)
    spec = await read_tool(bus, "acme.whoami")
    assert spec.namespace == "acme" and spec.description.startswith("Echo")
    assert spec.parameters["required"] == ["text"]
    assert [t.qualified for t in await list_tools(bus, "acme")] == [
        "acme.as_json", "acme.blob", "acme.explode", "acme.whoami"]
    first = spec.announced_at
    await eventually(lambda: _announced_after(bus, "acme.whoami", first), 5, "a heartbeat")

    result = await call_tool(bus, "acme.whoami", '{"text": "hi", "repeat": 2}')
    assert (result.output, result.error) == (f"{proc.pid}:hihi", "")
    assert (await call_tool(bus, "acme.as_json", '{"n": 3}')).output == (
        f'{{"pid":{proc.pid},"squares":[0,1,4]}}')

    proc.kill()
    proc.wait(timeout=10)
    with pytest.raises(TimeoutError):
        await call_tool(bus, "acme.whoami", '{"text": "hi"}', timeout_s=1.0)
    killed_at = time.monotonic()
    await eventually(lambda: _absent(bus, "acme.whoami"), TTL_S + 5, "the entry expires")
    assert time.monotonic() - killed_at <= TTL_S + 5
    await eventually(lambda: _none_listed(bus, "acme"), 2, "every acme tool expires")

    restarted = await start_and_wait(bus, tool_process)
    result = await call_tool(bus, "acme.whoami", '{"text": "back"}')
    assert result.output == f"{restarted.pid}:back"


async def _announced_after(bus: Bus, name: str, at: float) -> bool:
    spec = await read_tool(bus, name)
    return spec is not None and spec.announced_at > at


async def _none_listed(bus: Bus, namespace: str) -> bool:
    return await list_tools(bus, namespace) == []


async def _absent(bus: Bus, name: str) -> bool:
    return await read_tool(bus, name) is None


async def test_replicas_in_the_queue_group_share_calls(tools_bus, tool_process):
    bus = tools_bus
    replicas = [await start_and_wait(bus, tool_process) for _ in range(2)]
    pids = {str(p.pid) for p in replicas}
    served = Counter()
    # NATS picks a queue member at random per message: 60 calls miss a replica with p ~ 2**-59
    results = await asyncio.gather(*(call_tool(bus, "acme.whoami", f'{{"text": "{i}"}}', f"c{i}")
                                      for i in range(60)))
    for i, result in enumerate(results):
        pid, _, text = result.output.partition(":")
        assert text == str(i) and pid in pids
        served[pid] += 1
    assert set(served) == pids and sum(served.values()) == 60


async def test_bad_calls_come_back_as_errors_and_the_server_keeps_serving(tools_bus, tool_process):
    bus = tools_bus
    await start_and_wait(bus, tool_process)
    errors = {
        "not JSON": await call_tool(bus, "acme.whoami", '{"text": "unclosed'),
        "schema": await call_tool(bus, "acme.whoami", '{"text": 5}'),
        "unknown field": await call_tool(bus, "acme.whoami", '{"text": "a", "loud": true}'),
        "exception": await call_tool(bus, "acme.explode", '{"message": "kaboom"}'),
        "bytes": await call_tool(bus, "acme.blob"),
    }
    assert "are not valid JSON" in errors["not JSON"].error
    assert errors["schema"].error == "invalid arguments for whoami: Expected `str`, got `int` - at `$.text`"
    assert "unknown field `loud`" in errors["unknown field"].error
    assert errors["exception"].error == "acme.explode failed: RuntimeError: kaboom"
    assert errors["bytes"].error == "tool returned bytes, not text"
    assert all(r.output == "" for r in errors.values())
    garbage = TOOL.decode(await bus.request(tool_subject("acme.whoami"), b"\x00garbage", timeout_s=5))
    assert "malformed tool event" in garbage.error
    assert (await call_tool(bus, "acme.whoami", '{"text": "still here"}')).output.endswith("still here")


async def test_tenant_reward_is_served_and_range_checked(tools_bus, tool_process):
    bus = tools_bus
    await start_and_wait(bus, tool_process)

    async def score(*items: tuple[int, str]):
        request = RewardRequest(job="acme.j1", task="acme.length", items=[
            RewardItem(problem={"n": n}, completion=c) for n, c in items])
        return REWARD.decode(await bus.request(reward_subject("acme.length"), encode(request), 5))

    assert (await score((2, "ab"), (3, "ab"))).rewards == [1.0, 0.0]
    out_of_range = await score((2, "ab"), (-1, "x"))
    assert out_of_range.rewards == [] and "not a finite reward in [0, 1]" in out_of_range.error


async def test_sigterm_stops_the_tool_process_cleanly(tools_bus, tool_process):
    proc = await start_and_wait(tools_bus, tool_process)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 0


async def test_the_weather_example_runs_as_a_script(tools_bus, tool_process):
    tool_process(WEATHER_EXAMPLE)
    spec = await eventually(lambda: read_tool(tools_bus, "acme.weather"), 30, "weather is announced")
    assert spec.parameters["properties"]["city"]["type"] == "string"
    result = await call_tool(tools_bus, "acme.weather", '{"city": "Quellmar"}')
    assert result.error == "" and result.output.startswith("Quellmar: ")


# --- the env's built-in tools -----------------------------------------------------------------


@contextlib.asynccontextmanager
async def builtins(bus: Bus, home: Path, **env):
    config = load_config(overrides={"home": str(home), **{f"env.{k}": v for k, v in env.items()}},
                         env={})
    served = await serve_builtin_tools(bus, config)
    try:
        yield config
    finally:
        await served.stop()


async def test_builtin_tools_answer_over_the_bus(tools_bus, tmp_path):
    bus = tools_bus
    async with builtins(bus, tmp_path / "home", python_timeout_s=5.0, python_tool="env"):
        assert [t.name for t in await list_tools(bus, "builtin")] == ["calculator", "python", "search"]
        assert (await call_tool(bus, "calculator", '{"expression": "2**10 - 24"}')).output == "1000"
        refused = await call_tool(bus, "calculator", '{"expression": "__import__(\'os\')"}')
        assert "function calls are not allowed" in refused.error
        found = await call_tool(bus, "search", '{"query": "Ivesh trout length", "k": 1}')
        assert found.output.startswith("[1] Ivesh trout") and "80 centimetres" in found.output
        ran = await call_tool(bus, "python", '{"code": "print(6 * 7)"}', timeout_s=15)
        assert ran.error == "" and ran.output.startswith("42\n[exit code 0]")
    assert any((tmp_path / "home" / "cache" / "search").iterdir())  # the index was cached


async def test_injected_latency_delays_only_its_own_tool(tools_bus, tmp_path):
    bus = tools_bus
    async with builtins(bus, tmp_path / "home", tool_latency_s={"search": 1.5}):
        started = time.monotonic()
        done: dict[str, float] = {}

        async def timed(name: str, arguments: str) -> ToolResult:
            result = await call_tool(bus, name, arguments, call_id=name)
            done[name] = time.monotonic() - started
            return result

        slow, fast = await asyncio.gather(timed("search", '{"query": "heron"}'),
                                          timed("calculator", '{"expression": "1 + 1"}'))
        assert fast.output == "2" and done["calculator"] < 0.75
        assert "heron" in slow.output and done["search"] >= 1.5 and slow.elapsed_s >= 1.5


def test_tool_results_decode_as_the_tool_union():
    result = msgspec.json.decode(encode(ToolResult(call_id="x", output="y")))
    assert result["kind"] == "tool.result" and result["elapsed_s"] == 0.0
