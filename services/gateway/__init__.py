"""The tenants' HTTP API: a stateless ASGI app in front of the bus (``app.py`` assembles it)."""
