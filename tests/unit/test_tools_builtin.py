"""The built-in tools' pure cores, the @tool / @reward SDK and the tool names, without a broker."""

from __future__ import annotations

import json

import msgspec
import pytest

from marlaas.platform.config import ConfigError, load_config
from marlaas.platform.events import TOOL, RewardItem, RewardRequest, ToolCall, ToolResult, encode
from marlaas.tools import DEFAULT_CORPUS, ToolError, ToolNameError, qualify, reward, tool, tool_subject
from marlaas.tools.registry import reward_subject
from marlaas.tools.serving import answer_reward_request, answer_tool_call, tool_output
from services.env.tools import calculator_tool, search_tool
from services.env.tools.calculator import CalculatorError, calculate
from services.env.tools.latency import InjectedLatency
from services.env.tools.search import CorpusError, SearchIndex, read_corpus

# --- calculator -------------------------------------------------------------------------------


@pytest.mark.parametrize("expression, value", [
    ("1 + 2 * 3", 7),
    ("(1 + 2) * -3", -9),
    ("7 / 2", 3.5),
    ("7 // 2", 3),
    ("-7 % 3", 2),
    ("2 ** 10", 1024),
    ("2 ** -2", 0.25),
    ("+4 - -4", 8),
    ("1_000 * 3", 3000),
    ("123456789 * 987654321", 121932631112635269),
    ("2 ** 200", 2**200),
])
def test_calculator_evaluates_arithmetic(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression, reason", [
    ("x + 1", "names are not allowed"),
    ("__import__('os')", "function calls are not allowed"),
    ("abs(-1)", "function calls are not allowed"),
    ("(1).real", "attribute access is not allowed"),
    ("'a' * 3", "only numbers are allowed"),
    ("[1, 2]", "List is not allowed"),
    ("1 < 2", "comparisons are not allowed"),
    ("True + 1", "True is not allowed"),
    ("2 ^ 3", r"write powers with \*\*"),
    ("lambda: 1", "Lambda is not allowed"),
    ("1 +", "not an arithmetic expression"),
    ("", "expression is empty"),
])
def test_calculator_refuses_what_is_not_arithmetic(expression, reason):
    with pytest.raises(CalculatorError, match=reason):
        calculate(expression)


@pytest.mark.parametrize("expression", ["9 ** 9 ** 9", "3 ** 4000", "10 ** 1000 * 10 ** 1000 * 10 ** 1000",
                                        "10.0 ** 400", "1e308 * 10"])
def test_calculator_refuses_huge_results_without_computing_them(expression):
    with pytest.raises(CalculatorError, match="too large|not a finite number"):
        calculate(expression)


@pytest.mark.parametrize("expression", ["1 / 0", "5 // 0", "5 % 0", "1.5 / 0.0"])
def test_calculator_reports_division_by_zero(expression):
    with pytest.raises(CalculatorError, match="^division by zero$"):
        calculate(expression)


async def test_calculator_tool_answers_and_refuses_with_readable_errors():
    calc = calculator_tool()
    assert await calc.call('{"expression": "(3 + 4) * 2**10"}') == "7168"
    with pytest.raises(ToolError, match="names are not allowed"):
        await calc.call('{"expression": "x"}')


# --- search -----------------------------------------------------------------------------------


def write_corpus(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_search_ranks_the_passage_with_the_rare_term_first(tmp_path):
    corpus = write_corpus(tmp_path / "c.jsonl", [
        {"id": "a", "text": "The river flows north through the valley."},
        {"id": "b", "title": "Birds", "text": "The kestrel nests on the cliffs north of the river."},
        {"id": "c", "text": "North winds bring rain to the river valley."},
    ])
    index = SearchIndex.open(corpus, tmp_path / "cache")
    found = index.search("where does the kestrel nest, north of the river?", k=3)
    assert found[0][0].id == "b"
    assert [s for _, s in found] == sorted((s for _, s in found), reverse=True)


def test_search_tool_on_the_default_corpus_finds_the_fact(tmp_path):
    search = search_tool(SearchIndex.open(DEFAULT_CORPUS, tmp_path), default_k=2)
    assert search.parameters["properties"]["k"]["default"] == 2
    text = search("How deep is Lake Ivesh?")
    assert text.startswith("[1] Lake Ivesh (")
    assert "312 metres" in text.split("\n\n")[0]
    assert text.count("\n\n") == 1  # two passages
    assert search("zzyzx qwfp") == "no passage matches 'zzyzx qwfp'"


async def test_search_tool_refuses_bad_arguments(tmp_path):
    search = search_tool(SearchIndex.open(DEFAULT_CORPUS, tmp_path), default_k=3)
    with pytest.raises(ToolError, match="query is empty"):
        await search.call('{"query": "  "}')
    with pytest.raises(ToolError, match="k must be between 1 and 20"):
        await search.call('{"query": "heron", "k": 50}')


def test_search_index_is_cached_by_corpus_content(tmp_path):
    corpus = write_corpus(tmp_path / "c.jsonl", [{"id": i, "text": f"passage {w}"}
                                                 for i, w in enumerate(["alpha", "beta", "gamma"])])
    cache = tmp_path / "cache"
    first = SearchIndex.open(corpus, cache)
    second = SearchIndex.open(corpus, cache)
    assert (first.from_cache, second.from_cache) == (False, True)
    assert second.search("beta", 1)[0][0].text == "passage beta"
    assert len(list(cache.iterdir())) == 1  # one entry, named by the corpus's sha256
    write_corpus(corpus, [{"id": 1, "text": "passage delta"}])
    changed = SearchIndex.open(corpus, cache)
    assert not changed.from_cache and changed.search("delta", 5)[0][0].text == "passage delta"
    assert len(list(cache.iterdir())) == 2


def test_corpus_errors_name_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "text": "ok"}\n{"id": 2}\n')
    with pytest.raises(CorpusError, match=r"bad.jsonl:2: expected an object with a \"text\""):
        read_corpus(bad)
    with pytest.raises(CorpusError, match="does not exist"):
        read_corpus(tmp_path / "missing.jsonl")


# --- @tool: schema, validation, results -------------------------------------------------------


@tool
def lookup(city: str, days: int, tags: list[str], scale: float = 1.0, metric: bool = True,
           note: str | None = None) -> str:
    """Look up a forecast.

    Args:
        city: the city's name.
        days: how many days ahead,
            counting today.
    """
    return f"{city}/{days}/{tags}/{scale}/{metric}/{note}"


def test_tool_schema_is_derived_from_the_signature_and_docstring():
    assert lookup.name == "lookup"
    assert lookup.description == "Look up a forecast."
    schema = lookup.parameters
    assert schema["type"] == "object" and schema["additionalProperties"] is False
    assert schema["required"] == ["city", "days", "tags"]
    props = schema["properties"]
    assert props["city"] == {"type": "string", "description": "the city's name."}
    assert props["days"] == {"type": "integer", "description": "how many days ahead, counting today."}
    assert props["tags"] == {"type": "array", "items": {"type": "string"}}
    assert props["scale"] == {"type": "number", "default": 1.0}
    assert props["metric"] == {"type": "boolean", "default": True}
    assert props["note"]["default"] is None
    spec = lookup.spec("acme")
    assert spec.qualified == "acme.lookup"
    assert spec.function_schema()["function"]["parameters"] == schema
    assert lookup("Pell", 2, ["x"]) == "Pell/2/['x']/1.0/True/None"  # still a plain function


def test_tool_name_and_description_can_be_given():
    @tool(name="ping-pong", description="Answers pong.")
    def ping() -> str:
        return "pong"

    assert (ping.name, ping.description) == ("ping-pong", "Answers pong.")
    assert ping.parameters["properties"] == {}


def test_tool_needs_annotated_parameters_and_a_valid_name():
    def untyped(city):
        return city

    with pytest.raises(TypeError, match="parameter 'city' needs a type annotation"):
        tool(untyped)
    with pytest.raises(ToolNameError):
        tool(name="has.dot")(lambda: "x")


async def test_tool_arguments_are_validated_and_converted():
    assert await lookup.call('{"city": "Pell", "days": "3", "tags": []}') == "Pell/3/[]/1.0/True/None"
    for arguments, message in [
        ('{"city": "Pell"', "not valid JSON"),
        ('["Pell"]', "invalid arguments for lookup: Expected `object`"),
        ('{"city": "Pell", "tags": []}', "missing required field `days`"),
        ('{"city": "Pell", "days": "soon", "tags": []}', r"at `\$.days`"),
        ('{"city": "Pell", "days": 1, "tags": [], "extra": 1}', "unknown field `extra`"),
    ]:
        with pytest.raises(ToolError, match=message):
            await lookup.call(arguments)


@pytest.mark.parametrize("value, text", [
    ("plain", "plain"), ({"a": [1, 2]}, '{"a":[1,2]}'), ([1, "x"], '[1,"x"]'), (42, "42"),
])
def test_tool_results_become_text(value, text):
    assert tool_output(value) == text


@pytest.mark.parametrize("value, message", [
    (b"\x00", "tool returned bytes, not text"),
    (None, "tool returned NoneType, not text"),
    (object(), "tool returned object, not text"),
    ({"s": object()}, "tool returned a dict that is not JSON"),
])
def test_non_text_results_are_errors(value, message):
    with pytest.raises(ToolError, match=message):
        tool_output(value)


def test_long_results_are_truncated_visibly():
    text = tool_output("x" * 200_000)
    assert len(text) < 101_000 and text.endswith("[... truncated 100000 characters]")


async def test_answering_a_call_never_raises():
    @tool
    def boom(n: int) -> str:
        raise RuntimeError(f"bad {n}")

    @tool
    async def gives_bytes() -> bytes:
        return b"x"

    async def answer(t, data: bytes) -> ToolResult:
        result = TOOL.decode(encode(await answer_tool_call(t, "acme", data)))
        assert isinstance(result, ToolResult)
        return result

    def call(arguments: str, name: str = "") -> bytes:
        return encode(ToolCall(job="acme.j", call_id="c7", tool=name, arguments=arguments))

    ok = await answer(boom, call('{"n": "x"}'))
    assert ok.call_id == "c7" and "invalid arguments for boom" in ok.error
    failed = await answer(boom, call('{"n": 3}'))
    assert failed.error == "acme.boom failed: RuntimeError: bad 3" and failed.output == ""
    assert (await answer(gives_bytes, call("{}"))).error == "tool returned bytes, not text"
    assert "malformed tool event" in (await answer(boom, b"\xff not json")).error
    assert (await answer(boom, b'{"kind": "tool.call", "call_id": "c9"}')).call_id == "c9"
    assert "reached acme.boom" in (await answer(boom, call("{}", name="acme.other"))).error
    reply = await answer(boom, encode(ToolResult(call_id="c1")))
    assert "expected a tool.call" in reply.error


# --- @reward ----------------------------------------------------------------------------------


async def test_reward_results_must_be_finite_and_in_range():
    @reward("exact")
    def exact(problem: dict, completion: str) -> float:
        return {"good": 1.0, "nan": float("nan"), "big": 2.0, "text": "1"}[completion]

    def request(*completions: str) -> bytes:
        return encode(RewardRequest(job="acme.j", task="acme.exact",
                                    items=[RewardItem(problem={}, completion=c) for c in completions]))

    assert exact.name == "exact"
    assert (await answer_reward_request(exact, request("good", "good"))).rewards == [1.0, 1.0]
    for bad, message in [("nan", "not a finite reward"), ("big", "not a finite reward"),
                         ("text", "returned str, not a number"), ("unknown", "KeyError")]:
        result = await answer_reward_request(exact, request("good", bad))
        assert message in result.error and result.rewards == []
    assert "malformed reward event" in (await answer_reward_request(exact, b"{}")).error


# --- names, subjects, config ------------------------------------------------------------------


def test_names_qualify_to_subjects():
    assert qualify("search") == "builtin.search"
    assert qualify("acme.weather") == "acme.weather"
    assert tool_subject("search") == "marlaas.tool.builtin.search"
    assert tool_subject("acme-2.weather") == "marlaas.tool.acme-2.weather"
    assert reward_subject("addition") == "marlaas.reward.addition"
    assert reward_subject("acme.length") == "marlaas.reward.acme.length"
    for bad in ("Acme.weather", "a.b.c", "acme.", "acme.we ather", "acme.*", ">"):
        with pytest.raises(ToolNameError):
            qualify(bad)


def test_injected_latency_is_fixed_or_uniform():
    latency = InjectedLatency({"search": 1.5, "builtin.python": [0.2, 0.4]}, seed=1)
    assert latency("builtin.search") == 1.5
    assert all(0.2 <= latency("builtin.python") <= 0.4 for _ in range(50))
    assert latency("builtin.calculator") == 0.0
    assert not InjectedLatency({})


def test_env_config_validates_latency():
    config = load_config(overrides={"env.tool_latency_s": {"search": [0.1, 0.5], "python": 2}})
    assert config.env.tool_latency_s == {"search": [0.1, 0.5], "python": 2.0}
    for bad in ({"search": [0.5, 0.1]}, {"search": -1}, {"search": [1, 2, 3]}):
        with pytest.raises(ConfigError, match="tool_latency_s"):
            load_config(overrides={"env.tool_latency_s": bad})
    with pytest.raises(ConfigError):
        load_config(overrides={"env.search_top_k": 0})


def test_tool_spec_round_trips_on_the_wire():
    from marlaas.tools.registry import TOOL_SPEC

    spec = lookup.spec("acme")
    assert TOOL_SPEC.decode(msgspec.json.encode(spec)) == spec
