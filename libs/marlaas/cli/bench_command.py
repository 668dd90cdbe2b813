"""``marlaas bench``: a workload run under several schedules side by side, its report and plots."""

from __future__ import annotations

import signal
from pathlib import Path

import msgspec

from marlaas.cli.output import print_json
from marlaas.cli.stack_commands import interrupt


def cmd_bench(args, config) -> int:
    from rich.console import Console
    from rich.markdown import Markdown

    from marlaas.bench.fairness import bench_fairness, is_fairness_workload
    from marlaas.bench.plots import write_plots
    from marlaas.bench.progress import step_bars
    from marlaas.bench.report import check_targets, markdown_report
    from marlaas.bench.runner import run_benchmark
    from marlaas.bench.workload import BASELINE_LOOP, MODES, load_workload

    if is_fairness_workload(args.workload):  # tenants side by side, not schedules: a runner of its own
        signal.signal(signal.SIGTERM, interrupt)
        return bench_fairness(args, config)
    workload = load_workload(args.workload)
    modes = args.modes.split(",") if args.modes else workload.modes_to_run(args.quick)
    unknown = [m for m in modes if m not in (*MODES, BASELINE_LOOP)]
    if unknown:
        raise ValueError(f"--modes: unknown {unknown}; choose from {', '.join([*MODES, BASELINE_LOOP])}")
    out = Path(args.out or f"bench-results/{workload.name}{'-quick' if args.quick else ''}")
    out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, interrupt)  # a stopped benchmark stops the stack it runs
    console = Console(stderr=True)
    with step_bars(console) as progress:
        result = run_benchmark(workload, modes, args.quick, progress, base_model=config.base_model)
    (out / "results.json").write_bytes(msgspec.json.format(msgspec.json.encode(result)))
    report = markdown_report(result, workload.targets)
    (out / "results.md").write_text(report)
    plots = write_plots(result, out)
    if args.json:
        runs = [{k: v for k, v in r.items() if k not in ("timeline", "histograms")} for r in result["runs"]]
        checks = [{"target": c.target, "wanted": c.wanted, "measured": c.measured, "met": c.met}
                  for c in check_targets(result["runs"], workload.targets)]
        print_json({**{k: v for k, v in result.items() if k != "runs"}, "runs": runs, "targets": checks,
                     "out": str(out), "plots": [str(p) for p in plots]})
    else:
        Console().print(Markdown(report))
        console.print(f"results, report and plots in {out}/")
    return 0
