"""Entry point: `python -m services.manager --config PATH`."""

from marlaas.platform.runtime import run_service


def service():
    """The service's ``run``, imported only once config and logging are set up (transformers)."""
    from services.manager.service import run

    return run


if __name__ == "__main__":
    run_service("manager", service)
