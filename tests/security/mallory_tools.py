"""The attacker's own tool process for test_hostile_tenant.py: ``python mallory_tools.py`` serves
a reward as tenant mallory (NATS URL and token from MARLAAS_NATS_URL / MARLAAS_TOKEN)."""

from marlaas.tools import reward, serve, tool


@tool
def echo(text: str) -> str:
    """The text back."""
    return text


@reward("half")
def half(problem: dict, completion: str) -> float:
    return 0.5


if __name__ == "__main__":
    serve(echo, half, tenant="mallory")
