#!/usr/bin/env python3
"""Where the suite's time goes, read from a run's JUnit XML (pytest ``--junitxml``; `make test`
writes ``.test-results/junit.xml``).

    scripts/test-times.py report RUN.xml [--wall S]  # the wall time, the 15 slowest tests and files
    scripts/test-times.py record RUN.xml [--wall S]  # tests/durations.json (the scheduler's order)
                                                     # and docs/testing.md's table, from that run
    scripts/test-times.py table RUN.xml [RUN2.xml]   # the per-file table (two runs: side by side)

A test's time is its setup, call and teardown together (pytest's JUnit default): a module's stack
start lands on its first test, its stop on its last. Nothing here is written by hand: `record`
rewrites the part of docs/testing.md between its two ``durations`` comment lines.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from xml.etree import ElementTree

ROOT = Path(__file__).resolve().parents[1]
DURATIONS = ROOT / "tests" / "durations.json"
TESTING_DOC = ROOT / "docs" / "testing.md"
BEGIN, END = "<!-- durations: begin (scripts/test-times.py record) -->", "<!-- durations: end -->"
SLOWEST = 15


def read_run(path: Path) -> dict:
    """{"wall_s", "tests": {nodeid: seconds}, "outcomes": {outcome: count}} of one JUnit XML."""
    root = ElementTree.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    tests: dict[str, float] = {}
    outcomes: dict[str, int] = defaultdict(int)
    for case in suite.iter("testcase"):
        tests[nodeid_of(case)] = float(case.get("time") or 0.0)
        kinds = {child.tag for child in case}
        outcomes["failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"] += 1
    return {"wall_s": float(suite.get("time") or 0.0), "tests": tests, "outcomes": dict(outcomes)}


def nodeid_of(case) -> str:
    """``tests.integration.test_x.TestY`` + ``test_z[a]`` -> ``tests/integration/test_x.py::TestY::test_z[a]``."""
    parts = case.get("classname", "").split(".")
    at = max((i for i, part in enumerate(parts) if part.startswith("test_")), default=len(parts) - 1)
    return "::".join(["/".join(parts[: at + 1]) + ".py", *parts[at + 1:], case.get("name", "")])


def per_file(tests: dict[str, float]) -> dict[str, tuple[int, float]]:
    """{file: (tests, seconds)}, slowest first."""
    files: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for nodeid, seconds in tests.items():
        entry = files[nodeid.split("::", 1)[0]]
        entry[0] += 1
        entry[1] += seconds
    return {f: (n, s) for f, (n, s) in sorted(files.items(), key=lambda kv: -kv[1][1])}


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {int(round(seconds % 60)):02d} s"


def report(run: dict, wall_s: float | None) -> str:
    tests, outcomes = run["tests"], run["outcomes"]
    wall = wall_s if wall_s is not None else run["wall_s"]
    work = sum(tests.values())
    lines = [f"suite: {minutes(wall)} wall, {minutes(work)} of test time over the workers; "
             + ", ".join(f"{n} {kind}" for kind, n in sorted(outcomes.items())),
             f"the {SLOWEST} slowest tests (setup + call + teardown):"]
    for nodeid, seconds in sorted(tests.items(), key=lambda kv: -kv[1])[:SLOWEST]:
        lines.append(f"  {seconds:7.1f} s  {nodeid}")
    lines.append(f"the {SLOWEST} slowest files:")
    for file, (n, seconds) in list(per_file(tests).items())[:SLOWEST]:
        lines.append(f"  {seconds:7.1f} s  {file} ({n} tests)")
    return "\n".join(lines)


def table(runs: list[dict]) -> str:
    """The per-file markdown table: one run, or two side by side (before, after)."""
    files = [per_file(run["tests"]) for run in runs]
    names = sorted({f for fs in files for f in fs}, key=lambda f: -files[-1].get(f, (0, 0.0))[1])
    if len(runs) == 1:
        rows = ["| file | tests | seconds |", "|---|---:|---:|"]
        rows += [f"| {f} | {n} | {s:.0f} |" for f, (n, s) in files[0].items()]
        rows.append(f"| **all** | {len(runs[0]['tests'])} | {sum(runs[0]['tests'].values()):.0f} |")
        return "\n".join(rows)
    rows = ["| file | tests before | tests after | before s | after s |", "|---|---:|---:|---:|---:|"]
    for f in names:
        (nb, sb), (na, sa) = files[0].get(f, (0, 0.0)), files[1].get(f, (0, 0.0))
        rows.append(f"| {f} | {nb} | {na} | {sb:.0f} | {sa:.0f} |")
    rows.append(f"| **all** | {len(runs[0]['tests'])} | {len(runs[1]['tests'])} | "
                f"{sum(runs[0]['tests'].values()):.0f} | {sum(runs[1]['tests'].values()):.0f} |")
    return "\n".join(rows)


def record(run: dict, wall_s: float | None, source: str) -> None:
    """tests/durations.json and docs/testing.md's table, from ``run``."""
    files = per_file(run["tests"])
    wall = wall_s if wall_s is not None else run["wall_s"]
    DURATIONS.write_text(json.dumps({
        "source": source, "recorded": time.strftime("%Y-%m-%d"), "wall_s": round(wall, 1),
        "outcomes": run["outcomes"],
        "files": {f: round(s, 2) for f, (_, s) in files.items()},
        "tests": {nodeid: round(s, 2) for nodeid, s in sorted(run["tests"].items()) if s >= 1.0},
    }, indent=1, sort_keys=False) + "\n")
    doc = TESTING_DOC.read_text()
    if BEGIN not in doc or END not in doc:
        sys.exit(f"{TESTING_DOC} has no {BEGIN} ... {END} block to rewrite")
    head, rest = doc.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    slowest = report(run, wall_s).split("\n", 1)[1]  # the report less its first line, said here in words
    body = (f"\nRecorded {time.strftime('%Y-%m-%d')} from `{source}`: **{minutes(wall)}** wall, "
            + ", ".join(f"{n} {kind}" for kind, n in sorted(run["outcomes"].items()))
            + f"; {minutes(sum(run['tests'].values()))} of test time over the workers.\n\n"
            + f"```text\n{slowest}\n```\n\n{table([run])}\n")
    TESTING_DOC.write_text(head + BEGIN + body + END + tail)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("report", "record", "table"))
    parser.add_argument("runs", nargs="+", type=Path, help="JUnit XML files (pytest --junitxml)")
    parser.add_argument("--wall", type=float, help="the run's wall time in seconds (else the XML's)")
    args = parser.parse_args(argv)
    runs = [read_run(path) for path in args.runs]
    if args.command == "report":
        print(report(runs[0], args.wall))
    elif args.command == "record":
        record(runs[0], args.wall, str(args.runs[0]))
        print(f"wrote {DURATIONS.relative_to(ROOT)} and the table in {TESTING_DOC.relative_to(ROOT)}")
    else:
        print(table(runs[:2]))


if __name__ == "__main__":
    main(sys.argv[1:])
