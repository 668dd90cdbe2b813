"""The tenants' HTTP API: a stateless ASGI app in front of the bus (see ``app.py``)."""
