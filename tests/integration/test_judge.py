"""The ``judge`` reward against a real ``vllm serve`` of the character-level base (`builtin:char`,
no chat template), through the env service on a real nats-server; and the errors of a judge
that is unreachable or silent.

The tiny model's verdicts mean nothing: these tests check the path (subject, HTTP API,
concurrency, parsing) and the errors, not the judgement.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgspec
import pytest

from marlaas.basemodel import char_model_dir
from marlaas.platform.config import load_config
from marlaas.platform.events import REWARD, RewardItem, RewardRequest, RewardResult, encode
from marlaas.platform.runtime import Runtime
from marlaas.stack.embedded_nats import free_port
from marlaas.tools.registry import reward_subject
from services.env import service as env_service
from services.env.judge import Judge

pytestmark = [pytest.mark.stack,  # starts a vLLM engine: not in `make test-fast`
              pytest.mark.own_stack("`vllm serve` as the judge's OpenAI-compatible server")]

STARTUP_S = 240.0
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "search_qa"

QUESTIONS = [
    ({"question": "Capital of Velmora?", "answer": "Hadrath"}, "Hadrath"),
    ({"question": "Who founded Hadrath?", "answer": "Orlen Vasko"}, "<tool_response>x</tool_response> Pell"),
    ({"prompt": "Where was Vasko born?\nAnswer:", "answers": ["Pell", "Pell village"]}, "Pell"),
    ({"question": "Wreck found in?", "answer": "1988"}, "<think>hm</think>1988"),
]


def judge_request(job: str = "acme.qa-1") -> RewardRequest:
    return RewardRequest(job=job, task="search-qa",
                         items=[RewardItem(problem=p, completion=c) for p, c in QUESTIONS])


def judge_config(tmp_path, url: str, **env):
    overrides = {"home": str(tmp_path / "home"), "env.judge_url": url, "env.judge_model": "tiny",
                 **{f"env.{k}": v for k, v in env.items()}}
    return load_config(overrides=overrides, env={})


@pytest.fixture(scope="module")
def judge_url(tmp_path_factory):
    """``vllm serve`` of the tiny model on a free port (an OpenAI-compatible base URL); the whole
    process group is stopped at the end."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("judge") / "vllm.log"
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(char_model_dir()),
               "--dtype", "float32", "--max-model-len", "512", "--port", str(port), "--host", "127.0.0.1",
               "--served-model-name", "tiny", "--enforce-eager", "--max-num-seqs", "8"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CONFIGURE_LOGGING": "1"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + STARTUP_S
        while not _healthy(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"vllm serve did not come up (exit {proc.poll()}):\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        _stop_group(proc)


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _stop_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=20)
    with contextlib.suppress(ProcessLookupError):  # the engine core and any worker left in the group
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


@pytest.mark.timeout(300)
async def test_the_env_serves_judge_verdicts_for_every_item(judge_url, bus, file_store, tmp_path):
    config = judge_config(tmp_path, judge_url, judge_api="completions", judge_structured_verdict=True,
                          judge_concurrency=2)
    stop = asyncio.Event()
    rt = Runtime(name="env", config=config, bus=bus, store=file_store, stop=stop)
    env = asyncio.create_task(env_service.run(rt))
    try:
        await _until_subscribed(bus)
        reply = await bus.request(reward_subject("judge"), encode(judge_request()), timeout_s=60.0)
        result = REWARD.decode(reply)
        assert isinstance(result, RewardResult) and result.error == ""
        assert len(result.rewards) == len(QUESTIONS) and all(r in (0.0, 1.0) for r in result.rewards)
        # the task's own subject still scores by exact match / F1, not by the judge
        own = msgspec.structs.replace(judge_request(), dataset=str(EXAMPLES / "train.jsonl"),
                                      corpus=str(EXAMPLES / "corpus.jsonl"))
        scored = REWARD.decode(await bus.request(reward_subject("search-qa"), encode(own), timeout_s=30.0))
        assert scored.error == "" and scored.rewards == [1.0, 0.0, 1.0, 1.0]
    finally:
        stop.set()
        await asyncio.wait_for(env, 30)


async def _until_subscribed(bus) -> None:
    for _ in range(200):
        with contextlib.suppress(Exception):
            await bus.request(reward_subject("judge"), b"{}", timeout_s=0.2)
            return
        await asyncio.sleep(0.1)
    raise AssertionError("the env never answered on the judge's subject")


@pytest.mark.timeout(300)
async def test_unparseable_verdicts_and_a_wrong_api_are_errors(judge_url, tmp_path):
    judge = Judge(judge_config(tmp_path, judge_url, judge_api="completions").env)
    try:
        result = await judge.score(judge_request())
    finally:
        await judge.aclose()
    # unconstrained, the tiny model does not write yes / no: the request fails with the item and the fix
    assert result.rewards == [] and "is not yes, no or a score in [0, 1]" in result.error, result
    assert "judge_structured_verdict" in result.error and "acme.qa-1" in result.error

    judge = Judge(judge_config(tmp_path, judge_url, judge_api="chat").env)  # the tiny model has no chat template
    try:
        result = await judge.score(judge_request())
    finally:
        await judge.aclose()
    assert "answered HTTP 400" in result.error and 'judge_api = "completions"' in result.error


@pytest.mark.timeout(60)
async def test_an_unreachable_or_silent_judge_is_an_error(tmp_path):
    closed_port = free_port()
    judge = Judge(judge_config(tmp_path, f"http://127.0.0.1:{closed_port}/v1").env)
    result = await judge.score(judge_request())
    await judge.aclose()
    assert result.rewards == [] and f"127.0.0.1:{closed_port}/v1/chat/completions is unreachable" in result.error

    async def never_answer(reader, writer):
        await reader.read()  # holds the connection open until the client gives up
        writer.close()

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    judge = Judge(judge_config(tmp_path, f"http://127.0.0.1:{port}/v1", judge_timeout_s=0.5).env)
    started = time.monotonic()
    try:
        result = await judge.score(judge_request())
    finally:
        await judge.aclose()
        server.close()
    assert "did not answer within 0.5 s" in result.error and time.monotonic() - started < 5
