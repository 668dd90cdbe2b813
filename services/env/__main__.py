"""Entry point: `python -m services.env --config PATH`."""

from marlaas.platform.runtime import run_service


def service():
    """The service's ``run``, imported only once config and logging are set up (the tools, the judge)."""
    from services.env.service import run

    return run


if __name__ == "__main__":
    run_service("env", service)
