"""The platform's one error about a job's task and data, below both: ``marlaas.tasks`` raises it
for a task it cannot build, ``marlaas.platform.files`` for a data file the tenant does not have,
and the services catch it as one."""

from __future__ import annotations


class TaskError(ValueError):
    """A task was asked for with settings it cannot use (unknown name, bad dataset, missing file)."""
