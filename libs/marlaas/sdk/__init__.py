"""The tenants' SDK over the HTTP API: :class:`Client` and its typed results and errors."""

from marlaas.sdk.http import (
    BadRequest, Client, MarlaasError, NotFound, QuotaExceeded, ServerError, Unauthorized,
)
from marlaas.platform.http_api import EvalInfo, Event, JobInfo, PhaseSpan, VersionInfo

__all__ = [
    "BadRequest", "Client", "EvalInfo", "Event", "JobInfo", "MarlaasError", "NotFound", "PhaseSpan", "QuotaExceeded",
    "ServerError", "Unauthorized", "VersionInfo",
]
