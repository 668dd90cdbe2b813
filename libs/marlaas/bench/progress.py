"""Live progress of benchmark runs: one bar per run, in steps (rich)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from marlaas.bench.runner import Progress as ProgressCallback


@contextlib.contextmanager
def step_bars(console: Console) -> Iterator[ProgressCallback]:
    """A ``progress(label, done, total)`` callback that draws a bar per label while in the block."""
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("steps"),
                  TimeElapsedColumn(), console=console) as bar:
        rows: dict[str, int] = {}

        def progress(label: str, done: int, total: int) -> None:
            if label not in rows:
                rows[label] = bar.add_task(label, total=total)
            bar.update(rows[label], completed=done, total=total)

        yield progress
