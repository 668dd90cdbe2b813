"""The tenants' SDK over the HTTP API: :class:`Client` and its typed results and errors."""

from marlaas.sdk.http import (
    BadRequest, Client, MarlaasError, NotFound, QuotaExceeded, ServerError, Unauthorized,
)
from marlaas.platform.http_api import EvalInfo, Event, JobInfo, VersionInfo

__all__ = [
    "BadRequest", "Client", "EvalInfo", "Event", "JobInfo", "MarlaasError", "NotFound", "QuotaExceeded",
    "ServerError", "Unauthorized", "VersionInfo",
]
