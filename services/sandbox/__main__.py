"""Entry point: `python -m services.sandbox --config PATH` (its broker URL from MARLAAS_NATS_URL)."""

from marlaas.platform.nats_access import SANDBOX_USER, inbox_prefix
from marlaas.platform.runtime import run_service

if __name__ == "__main__":
    run_service("sandbox", platform=False, inbox_prefix=inbox_prefix(SANDBOX_USER))
