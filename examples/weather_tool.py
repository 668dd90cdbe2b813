"""A tenant's tool for agentic jobs: `python examples/weather_tool.py` next to `marlaas up`."""
from marlaas.tools import serve, tool


@tool
def weather(city: str, unit: str = "celsius") -> str:
    """Today's weather in a city (made up: this is an example).

    Args:
        city: the city's name, e.g. "Quellmar".
        unit: "celsius" or "fahrenheit".
    """
    degrees = 5 + sum(map(ord, city)) % 25
    shown = degrees * 9 / 5 + 32 if unit == "fahrenheit" else degrees
    return f"{city}: {shown:.0f} degrees {unit}, light rain"


if __name__ == "__main__":
    serve(weather, tenant="acme")
