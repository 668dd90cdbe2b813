"""Entry point: `python -m services.trainer --config PATH`."""

from marlaas.platform.runtime import run_service


def service():
    """The service's ``run``, imported only once config and logging are set up (torch, peft)."""
    from services.trainer.service import run

    return run


if __name__ == "__main__":
    run_service("trainer", service)
