"""No regex (or hand-written scanner) on untrusted text can backtrack (issue 35).

A model's output, a tool's output, a reward's or judge's reply and every byte a tenant sends
are untrusted: one pattern that backtracks on them stops a shared service for every tenant
(the tool-call bracket scan did: exponential on an unclosed JSON string). So:

- every regex compiled anywhere in ``libs/`` and ``services/`` is compiled at module level
  (where this audit finds it), and no module calls ``re.search(pattern_string, ...)`` inline;
- each pattern, and each scanner that reads model output, runs on adversarial strings of
  100 kB built from its own literals (long runs, a literal prefix then a long run, repeated
  literals) in a child process, and must finish within a bound measured in this run: a small
  multiple of a pure-Python linear scan of the same input. A pattern that is quadratic or
  worse takes seconds to hours on such input; a linear one takes about a millisecond.
"""

from __future__ import annotations

import ast
import importlib
import multiprocessing
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from marlaas.tools.protocol import json_depth, parse_call, without_thinking

ROOT = Path(__file__).resolve().parents[2]
SIZE = 100_000  # characters of each adversarial input
RATIO = 25  # at most this many linear scans' time (C regexes run far below 1; quadratic far above)
SLACK_S = 0.05  # for timer noise and the match objects a pattern with many matches creates
CHILD_TIMEOUT_S = 120.0  # what a pattern that never returns is given before it is reported
GENERIC = (" ", "\n", "\t", "a", "Z", "0", "9", ".", ",", "-", "$", ":", "\\", '"', "`", "<", ">", "/", "#",
           "{", "}", "[", "]", "(", ")")


def source_files() -> list[Path]:
    return sorted(p for top in ("libs", "services") for p in (ROOT / top).rglob("*.py"))


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT / "libs") if path.is_relative_to(ROOT / "libs") else path.relative_to(ROOT)
    return ".".join(rel.with_suffix("").parts).removesuffix(".__init__")


def regex_calls(path: Path) -> tuple[list[ast.Call], list[ast.Call]]:
    """The ``re.compile`` calls at module level, and every other ``re.*`` call (compiles inside
    functions included), of one file."""
    tree = ast.parse(path.read_text(), str(path))
    at_module = {id(node) for stmt in tree.body for node in ast.walk(stmt)
                 if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    compiled, other = [], []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "re"
                and node.func.attr not in ("escape", "error", "Pattern", "Match")):
            (compiled if node.func.attr == "compile" and id(node) in at_module else other).append(node)
    return compiled, other


def platform_patterns() -> dict[str, re.Pattern]:
    """Every module-level compiled pattern of libs/ and services/, by ``module.NAME[index]``."""
    found: dict[str, re.Pattern] = {}
    for path in source_files():
        compiled, _ = regex_calls(path)
        if not compiled:
            continue
        module = importlib.import_module(module_name(path))
        for name, value in vars(module).items():
            values = value if isinstance(value, (tuple, list)) else (value,)
            for k, item in enumerate(values):
                if isinstance(item, re.Pattern):
                    found[f"{module.__name__}.{name}" + (f"[{k}]" if values is value else "")] = item
    return found


def literals(pattern: re.Pattern) -> tuple[list[str], list[str]]:  # noqa: C901 -- one walk, a branch per opcode
    """The literal words of ``pattern`` (runs of literal characters, in order) and every single
    character it names (literals and the ends of classes' ranges)."""
    from re import _constants as c
    from re import _parser

    words, chars, run = [], set(), []

    def flush() -> None:
        if run:
            words.append("".join(run))
            run.clear()

    def walk(items) -> None:
        for op, av in items:
            if op is c.LITERAL:
                run.append(chr(av))
                chars.add(chr(av))
                continue
            flush()
            if op is c.SUBPATTERN:
                walk(av[-1])
            elif op in (c.MAX_REPEAT, c.MIN_REPEAT, c.POSSESSIVE_REPEAT):
                walk(av[2])
            elif op is c.ATOMIC_GROUP:
                walk(av)
            elif op is c.BRANCH:
                for branch in av[1]:
                    walk(branch)
                    flush()
            elif op is c.IN:
                for item_op, item in av:
                    if item_op is c.LITERAL:
                        chars.add(chr(item))
                    elif item_op is c.RANGE:
                        chars.update((chr(item[0]), chr(item[1])))
            elif op is c.NOT_LITERAL:
                chars.add(chr(av))
        flush()

    walk(_parser.parse(pattern.pattern, pattern.flags))
    return [w for w in dict.fromkeys(words) if len(w) > 1], sorted(chars | set(GENERIC))


def adversarial_inputs(words: list[str], chars: list[str]) -> list[str]:
    """Strings of about ``SIZE`` characters: each character and word repeated; each word, and the
    words in order, followed by a long run of one character; a word and a character alternating."""
    def fill(unit: str) -> str:
        return unit * (SIZE // max(len(unit), 1))

    inputs = [fill(a) for a in (*chars, *words)]
    prefixes = [*words, "".join(words), " ".join(words)] if words else []
    for prefix in prefixes:
        inputs += [prefix + fill(ch) for ch in chars]
    for word in words:
        inputs += [fill(word + ch) for ch in chars]
    return inputs


def scanners() -> dict[str, tuple[Callable[[str], object], list[str], list[str]]]:
    """The hand-written readers of model output, with the literals their inputs are built from."""
    call_words = ["<tool_call>", '{"name": "f", "arguments": {"q": "', '\\"', "</tool_call>"]
    return {
        "protocol.json_depth": (lambda t: json_depth(t, 32), ['"', '\\"', "[", "{", '"\\'], list(GENERIC)),
        "protocol.parse_call": (parse_call, call_words, list(GENERIC)),
        "protocol.without_thinking": (without_thinking, ["<think>", "</think>", "<think"], list(GENERIC)),
    }


def linear_scan_s(text: str) -> float:
    started = time.perf_counter()
    for _ in text:
        pass
    return time.perf_counter() - started


def _measure(target: str, conn) -> None:
    """Child: run ``target`` on each of its inputs, sending (input index, elapsed, linear scan) as it goes."""
    if target in scanners():
        fn, words, chars = scanners()[target]
    else:
        pattern = platform_patterns()[target]
        words, chars = literals(pattern)

        def fn(text: str) -> object:
            return sum(1 for _ in pattern.finditer(text)), pattern.fullmatch(text)
    for index, text in enumerate(adversarial_inputs(words, chars)):
        conn.send(("start", index, text[:60]))
        best = float("inf")
        for _ in range(3):  # the fastest of a few: the machine is shared and noisy
            started = time.perf_counter()
            fn(text)
            best = min(best, time.perf_counter() - started)
            if best <= RATIO * linear_scan_s(text) + SLACK_S:
                break
        conn.send(("done", index, best, min(linear_scan_s(text) for _ in range(3))))
    conn.send(("end",))


def audit(target: str) -> None:
    """Run ``target``'s inputs in a child (a backtracking pattern may never return: it is killed),
    and fail naming the first input over the bound."""
    parent, child = multiprocessing.get_context("fork").Pipe()
    process = multiprocessing.get_context("fork").Process(target=_measure, args=(target, child), daemon=True)
    process.start()
    deadline, current = time.monotonic() + CHILD_TIMEOUT_S, None
    try:
        while True:
            if not parent.poll(max(deadline - time.monotonic(), 0)):
                pytest.fail(f"{target} did not finish on input {current!r}... within {CHILD_TIMEOUT_S:g} s: "
                            "it backtracks; rewrite it without nested or adjacent quantifiers over the same "
                            "characters (possessive *+ / ++, or a scan with str.find)")
            message = parent.recv()
            if message[0] == "end":
                return
            if message[0] == "start":
                current = message[2]
                continue
            _, index, elapsed, linear = message
            bound = RATIO * linear + SLACK_S
            assert elapsed <= bound, (f"{target} took {elapsed * 1e3:.1f} ms on input {current!r}... "
                                      f"({SIZE} chars), over {bound * 1e3:.1f} ms ({RATIO}x a linear scan's "
                                      f"{linear * 1e3:.1f} ms): it backtracks")
    finally:
        process.kill()
        process.join()


def test_every_regex_is_compiled_at_module_level_where_the_audit_sees_it():
    inline = [f"{path.relative_to(ROOT)}:{call.lineno} re.{call.func.attr}"
              for path in source_files() for call in regex_calls(path)[1]]
    assert not inline, (f"regexes this audit cannot see: {inline}; compile each at module level "
                        "(NAME = re.compile(...)) so tests/integration/test_regex_audit.py runs it on adversarial "
                        "input")


def test_the_audit_finds_the_patterns_that_read_model_and_tenant_text():
    names = set(platform_patterns())
    for expected in ("marlaas.tasks.gsm8k._MARKERS[0]", "marlaas.tasks.gsm8k._NUMBERS",
                     "services.env.judge._LABEL", "marlaas.tasks.search_qa._ANSWER_LABEL",
                     "services.gateway.submission._MISSING"):
        assert expected in names
    assert len(names) >= 20


@pytest.mark.parametrize("target", sorted(platform_patterns()) + sorted(scanners()))
def test_no_pattern_or_scanner_backtracks_on_adversarial_input(target):
    audit(target)


@pytest.mark.parametrize("pattern, adversary", [
    (r'"(?:[^"\\]+|\\.)*"|[\[\]{}]', '"' + "a" * 40),  # the old tool-call bracket scan: exponential
    (r"<think>.*?</think>", "<think>" * 8_000),  # the old think-block strip: quadratic
    (r"####\s*(-?\$?\s*\d)", "####" + " " * 20_000),  # two \s* over one run of spaces: quadratic
])
def test_the_audit_catches_a_pattern_that_backtracks(pattern, adversary, monkeypatch):
    """The harness itself can fail: the patterns issue 35 replaced are caught by it."""
    compiled, this = re.compile(pattern, re.DOTALL), sys.modules[__name__]
    monkeypatch.setattr(this, "platform_patterns", lambda: {"bad": compiled})
    monkeypatch.setattr(this, "adversarial_inputs", lambda words, chars: [adversary])
    monkeypatch.setattr(this, "CHILD_TIMEOUT_S", 3.0)
    with pytest.raises((AssertionError, pytest.fail.Exception)):
        audit("bad")
