"""Entry point: `python -m services.sandbox --config PATH` (its broker URL from MARLAAS_NATS_URL)."""

from marlaas.platform.nats_access import SANDBOX_USER, inbox_prefix
from marlaas.platform.runtime import run_service


def service():
    """The service's ``run``, imported only once config and logging are set up."""
    from services.sandbox.service import run

    return run


if __name__ == "__main__":
    run_service("sandbox", service, platform=False, inbox_prefix=inbox_prefix(SANDBOX_USER))
