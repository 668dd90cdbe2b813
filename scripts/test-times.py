#!/usr/bin/env python3
"""Where the suite's time goes, per test file: a markdown table from pytest's ``--durations=0`` output.

    python -m pytest -q tests --durations=0 | tee run.log
    scripts/test-times.py run.log                 # one run
    scripts/test-times.py before.log after.log    # side by side

``setup`` is fixture time (a module's stack start lands on its first test's setup), ``call``
the test bodies (job waits included), ``teardown`` stopping what the fixtures started.
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from pathlib import Path
from xml.etree import ElementTree

LINE = re.compile(r"^\s*([\d.]+)s (setup|call|teardown)\s+(\S+?)::(\S+)")


def per_file(path: str) -> tuple[dict[str, dict[str, float]], dict[str, set[str]]]:
    """{file: {phase: seconds}} and {file: test ids}. pytest hides durations under 5 ms unless
    ``--durations-min=0``: a JUnit XML of the same run beside the log (``run.xml`` for
    ``run.log``, from ``--junitxml``) gives the full count of tests per file."""
    times: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    tests: dict[str, set[str]] = defaultdict(set)
    with open(path, errors="replace") as f:
        for line in f:
            if m := LINE.match(line):
                seconds, phase, file, test = float(m[1]), m[2], m[3], m[4]
                times[file][phase] += seconds
                tests[file].add(test)
    junit = Path(path).with_suffix(".xml")
    if junit.exists():
        tests = defaultdict(set)
        for case in ElementTree.parse(junit).iter("testcase"):
            module = case.get("classname", "")
            while module and not module.rsplit(".", 1)[-1].startswith("test_"):
                module = module.rsplit(".", 1)[0]  # a test class's name: up to its module
            tests[module.replace(".", "/") + ".py"].add(f"{case.get('classname')}::{case.get('name')}")
    return times, tests


def total(phases: dict[str, float]) -> float:
    return sum(phases.values())


def main(paths: list[str]) -> None:
    runs = [per_file(p) for p in paths]
    files = sorted({f for times, tests in runs for f in (*times, *tests)},
                   key=lambda f: -total(runs[0][0].get(f, {})))
    if len(runs) == 1:
        times, tests = runs[0]
        print("| file | tests | setup s | call s | teardown s | total s |")
        print("|---|---:|---:|---:|---:|---:|")
        for f in files:
            p = times.get(f, {"setup": 0.0, "call": 0.0, "teardown": 0.0})
            print(f"| {f} | {len(tests[f])} | {p['setup']:.0f} | {p['call']:.0f} | {p['teardown']:.0f} | "
                  f"{total(p):.0f} |")
        print(f"| **all** | {sum(len(t) for t in tests.values())} | "
              + " | ".join(f"{sum(p[ph] for p in times.values()):.0f}" for ph in ("setup", "call", "teardown"))
              + f" | {sum(total(p) for p in times.values()):.0f} |")
        return
    (before, btests), (after, atests) = runs[:2]
    print("| file | tests before | tests after | before s | after s | after: setup / call / teardown s |")
    print("|---|---:|---:|---:|---:|---|")
    for f in files:
        a = after.get(f, {"setup": 0.0, "call": 0.0, "teardown": 0.0})
        print(f"| {f} | {len(btests.get(f, ()))} | {len(atests.get(f, ()))} | {total(before.get(f, {})):.0f} | "
              f"{total(a):.0f} | {a['setup']:.0f} / {a['call']:.0f} / {a['teardown']:.0f} |")
    print(f"| **all** | {sum(len(t) for t in btests.values())} | {sum(len(t) for t in atests.values())} | "
          f"{sum(total(p) for p in before.values()):.0f} | {sum(total(p) for p in after.values()):.0f} | |")


if __name__ == "__main__":
    if not sys.argv[1:]:
        sys.exit(__doc__)
    main(sys.argv[1:])
