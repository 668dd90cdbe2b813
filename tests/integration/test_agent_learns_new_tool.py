"""An ``agent`` job on the chat base learns to use a tool it has never seen (issue 25's "done when").

A tenant's process serves two made-up tools (``examples/made_up_tools.py``, which ``make demo``
runs too: names, keywords and
arguments from the pretraining's held-out words, so the base knows them only by the schema
its chat template shows it). The job's dataset (an uploaded file) asks for a city's
"mutrol", which only ``get_mutrol`` answers; the reward is the built-in ``contains`` matcher.
Over 40 versions the right tool is called far more often than the other, and the share of
episodes with a successful call and the reward both rise; the trainer reproduces the
engine's logprobs of every turn (the on-policy audit) on this BPE model.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from marlaas.basemodel import builtin_model_dir
from marlaas.basemodel.pretrain import SEED as PRETRAIN_SEED
from marlaas.basemodel.synthetic import Corpus, split_of
from marlaas.platform.audit import audit_training
from marlaas.platform.bus import Bus
from marlaas.platform.config import load_config
from marlaas.platform.files import put_file
from marlaas.platform.nats_client import BusClient
from marlaas.platform.store import open_store
from marlaas.platform.telemetry import read_spans
from marlaas.stack.launcher import Stack
from marlaas.tools.registry import read_tool

pytestmark = [pytest.mark.stack,  # starts a vLLM engine: not in `make test-fast`
              pytest.mark.own_stack("rollout.block_size = 32 for ~100-token episodes: a config of its own")]

TOOLS_FILE = Path(__file__).resolve().parents[2] / "examples" / "made_up_tools.py"
_spec = importlib.util.spec_from_file_location("made_up_tools", TOOLS_FILE)
made_up_tools = importlib.util.module_from_spec(_spec)  # the tool process's own module: its table is the data
_spec.loader.exec_module(made_up_tools)

STEPS = 40
TOOLS = ["acme.get_mutrol", "acme.tashom_lookup"]


def mean(values) -> float:
    return statistics.mean(values) if values else 0.0


def test_the_tools_are_unknown_to_the_pretraining_data():
    """Held-out words by construction; and no word of every training tool and of a sample of
    training episodes is one of them (made-up words share syllables: "droxbouze" holds "bouze")."""
    assert all(split_of(word) == "heldout" for word in made_up_tools.KEYWORDS + made_up_tools.CITIES)
    corpus = Corpus(PRETRAIN_SEED)
    seen = json.dumps([t.schema for t in corpus.tools] + [e.messages for e in corpus.episodes(2000)]).lower()
    words = set(re.findall(r"[a-z]+", seen))
    assert words.isdisjoint(w.lower() for w in made_up_tools.KEYWORDS + made_up_tools.CITIES)


@pytest.mark.timeout(900)
def test_an_agent_job_learns_to_call_a_tool_it_has_never_seen(tmp_path):
    config = load_config(overrides={"home": str(tmp_path / "home"), "gateway.port": 0,
                                    "base_model": str(builtin_model_dir()), "rollout.prompt_format": "chat",
                                    "rollout.block_size": 32}, env={})
    calls_log = tmp_path / "calls.log"
    calls_log.touch()
    rows = "".join(json.dumps(row) + "\n" for row in made_up_tools.dataset_rows()).encode()

    async def go(stack: Stack):
        client = await BusClient.connect(stack.nats_url)
        deadline = time.monotonic() + 60
        while any([await read_tool(client.bus, name) is None for name in TOOLS]):
            assert time.monotonic() < deadline, "the tools never announced themselves"
            await asyncio.sleep(0.2)
        dataset = put_file(open_store(stack.resolved.store_url), "acme", rows, "mutrol.jsonl").id
        job = await client.submit({"task": "agent", "tenant": "acme", "steps": STEPS, "seed": 1, "dataset": dataset,
                                   "tools": TOOLS, "reward": "contains", "system": "Use the tools when they help.",
                                   "grpo": {"max_new_tokens": 40, "prompts_per_step": 4}})
        (view,) = await client.wait([job], timeout_s=780)
        await client.close()
        bus = await Bus.connect(stack.nats_url)
        spans = [s for s in await read_spans(bus) if s.job == job]
        await bus.close()
        return view, spans

    started = time.time()
    with Stack(config) as stack:
        tools = subprocess.Popen([sys.executable, str(TOOLS_FILE), str(calls_log)],
                                 env={"MARLAAS_NATS_URL": stack.nats_url, "PATH": "/usr/bin:/bin"})
        try:
            trained_from = time.time()
            view, spans = asyncio.run(go(stack))
        finally:
            tools.terminate()
            tools.wait(timeout=30)
    print(f"{STEPS} versions in {time.time() - trained_from:.0f}s ({time.time() - started:.0f}s with the stack)")
    assert view.state == "completed" and view.version == STEPS, view

    calls = Counter(calls_log.read_text().split())
    success, rewards = view.metrics["tool/success_rate"], view.rewards
    print(f"calls by tool: {dict(calls)}")
    print(f"successful-call share per version: {[round(x, 2) for x in success]}")
    print(f"reward per version: {[round(x, 2) for x in rewards]}")
    print(f"first5 / last5: success {mean(success[:5]):.2f} -> {mean(success[-5:]):.2f}, "
          f"reward {mean(rewards[:5]):.3f} -> {mean(rewards[-5:]):.3f}")
    assert calls["get_mutrol"] >= 5 * max(calls["tashom_lookup"], 1)  # the right tool, far more often
    assert len(success) == len(rewards) == STEPS
    assert mean(success[-5:]) >= mean(success[:5]) + 0.1
    assert mean(rewards[-5:]) >= mean(rewards[:5]) + 0.1
    assert audit_training(spans) == []  # on-policy across turns on the BPE model
