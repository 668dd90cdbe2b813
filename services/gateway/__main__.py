"""Entry point: `python -m services.gateway --config PATH`."""

from marlaas.platform.runtime import run_service


def service():
    """The service's ``run``, imported only once config and logging are set up (litestar, uvicorn)."""
    from services.gateway.service import run

    return run


if __name__ == "__main__":
    run_service("gateway", service)
