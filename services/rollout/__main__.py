"""Entry point: `python -m services.rollout --config PATH`."""

from marlaas.runtime import run_service


def main() -> None:
    from services.rollout.service import run  # heavy imports happen after config and logging

    run_service("rollout", run)


if __name__ == "__main__":
    main()
