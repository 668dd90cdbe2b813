"""Entry point: `python -m services.rollout --config PATH`."""

from marlaas.platform.runtime import run_service

if __name__ == "__main__":
    run_service("rollout")
