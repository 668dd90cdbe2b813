"""Entry point: `python -m services.trainer --config PATH`."""

from marlaas.runtime import run_service


def main() -> None:
    from services.trainer.service import run  # heavy imports happen after config and logging

    run_service("trainer", run)


if __name__ == "__main__":
    main()
