"""Entry point: `python -m services.env --config PATH`."""

from marlaas.runtime import run_service


def main() -> None:
    from services.env.service import run  # heavy imports happen after config and logging

    run_service("env", run)


if __name__ == "__main__":
    main()
