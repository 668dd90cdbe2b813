"""marlaas: multi-tenant asynchronous RL for LLMs, as a service.

``marlaas.Client`` is the tenants' HTTP SDK (:mod:`marlaas.sdk`), imported on first use so
that the services, which import this package too, do not load httpx.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from marlaas.sdk import Client

__all__ = ["Client"]


def __getattr__(name: str):
    if name == "Client":
        from marlaas.sdk import Client

        return Client
    raise AttributeError(f"module 'marlaas' has no attribute {name!r}")
