"""The tenants' SDK over the HTTP API: :class:`Client` and its typed results and errors."""

from marlaas.platform.http_api import (
    EvalInfo,
    Event,
    JobInfo,
    PhaseSpan,
    SampleEpisode,
    SampleGroup,
    SampleTurn,
    VersionInfo,
    VersionSamples,
)
from marlaas.sdk.http import (
    BadRequest,
    Client,
    MarlaasError,
    NotFound,
    QuotaExceeded,
    ServerError,
    Unauthorized,
)

__all__ = [
    "BadRequest", "Client", "EvalInfo", "Event", "JobInfo", "MarlaasError", "NotFound", "PhaseSpan", "QuotaExceeded",
    "SampleEpisode", "SampleGroup", "SampleTurn", "ServerError", "Unauthorized", "VersionInfo", "VersionSamples",
]
