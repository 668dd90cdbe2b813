"""The built-in search tool over a real nats-server answers from the corpus a job's calls name
in their context, and reports a corpus it cannot read as an error result."""

from __future__ import annotations

from pathlib import Path

import pytest

from marlaas.platform.config import load_config
from marlaas.platform.events import TOOL, ToolCall, ToolResult, encode
from marlaas.tasks import get_task
from marlaas.tools import tool_subject
from services.env.tools import serve_builtin_tools

pytestmark = pytest.mark.timeout(120)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "search_qa"


async def search(bus, query: str, context: dict[str, str]) -> ToolResult:
    call = ToolCall(job="acme.qa-1", call_id="c1", tool="builtin.search",
                    arguments=f'{{"query": "{query}", "k": 1}}', context=context)
    result = TOOL.decode(await bus.request(tool_subject("search"), encode(call), timeout_s=15.0))
    assert isinstance(result, ToolResult) and result.call_id == "c1"
    return result


async def test_search_answers_from_the_job_corpus_named_in_the_call(bus, tmp_path):
    config = load_config(overrides={"home": str(tmp_path / "home")}, env={})
    task = get_task("search-qa", str(EXAMPLES / "train.jsonl"), str(EXAMPLES / "corpus.jsonl"))
    served = await serve_builtin_tools(bus, config)
    try:
        own = await search(bus, "who discovered the glass shrimp", task.tool_context())
        assert own.error == "" and own.output.startswith("[1] Marta Quill (sci-2)")
        default = await search(bus, "Ivesh trout length", {})  # no context: the configured corpus
        assert default.output.startswith("[1] Ivesh trout")
        missing = await search(bus, "glass shrimp", {"corpus": str(tmp_path / "gone.jsonl")})
        assert missing.output == "" and "gone.jsonl does not exist" in missing.error
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"id": 1, "text": "fine"}\n{"id": 2}\n')
        malformed = await search(bus, "fine", {"corpus": str(bad)})
        assert 'bad.jsonl:2: expected an object with a "text" string' in malformed.error
        again = await search(bus, "copper-roofed lighthouse", task.tool_context())  # still serving
        assert again.output.startswith("[1] Hadrath (vel-2)")
    finally:
        await served.stop()
    assert len(list((tmp_path / "home" / "cache" / "search").iterdir())) == 2  # both corpora cached
