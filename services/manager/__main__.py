"""Entry point: `python -m services.manager --config PATH`."""

from marlaas.runtime import run_service


def main() -> None:
    from services.manager.service import run  # heavy imports happen after config and logging

    run_service("manager", run)


if __name__ == "__main__":
    main()
