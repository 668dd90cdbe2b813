"""Longer chaos runs than the test's: ``python benchmarks/chaos.py --jobs 8 --steps 40 --kills 60``.

Prints each kill as it happens, then the counts (kills by service, injected trainer crashes by
point, batches retrained after a crash) and every problem found; exits 1 if there is one.
"""

from __future__ import annotations

import argparse
import json
import sys

from marlaas.bench.chaos import run_chaos


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--kills", type=int, default=30, help="service kills at least (injected crashes count)")
    parser.add_argument("--nats-restarts", type=int, default=2)
    parser.add_argument("--crash-p", type=float, default=0.08, help="trainer self-kill odds at each commit point")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=3600.0)
    args = parser.parse_args()
    result = run_chaos(jobs=args.jobs, steps=args.steps, min_kills=args.kills, nats_restarts=args.nats_restarts,
                       crash_p=args.crash_p, seed=args.seed, timeout_s=args.timeout,
                       on_event=lambda line: print(line, flush=True))
    print(json.dumps(result, indent=2))
    return 1 if result["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
