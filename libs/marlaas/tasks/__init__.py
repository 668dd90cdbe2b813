"""Built-in tasks and the registry that names them."""

from __future__ import annotations

from marlaas.tasks.agent import Agent
from marlaas.tasks.agentic import Multiply
from marlaas.tasks.base import Task, TaskError
from marlaas.tasks.gsm8k import Gsm8k
from marlaas.tasks.search_qa import SearchQa
from marlaas.tasks.sft import Sft
from marlaas.tasks.toy import Addition, Repeat, Reverse

REGISTRY: dict[str, type[Task]] = {
    t.name: t for t in (Addition, Reverse, Repeat, Multiply, Gsm8k, SearchQa, Agent, Sft)}


def get_task(name: str, dataset: str | None = None, corpus: str | None = None) -> Task:
    """Build the task ``name``; an unknown name lists the known ones."""
    try:
        cls = REGISTRY[name]
    except KeyError:
        raise TaskError(f"unknown task {name!r}; known tasks: {', '.join(sorted(REGISTRY))}") from None
    return cls(dataset, corpus)


__all__ = ["REGISTRY", "Task", "TaskError", "get_task"]
