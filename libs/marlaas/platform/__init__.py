"""The platform: wire contracts (``events``, ``api``, ``http_api``), the bus and the object store,
config, the services' runtime, tenants' records, and what clients need to reach the broker.

Nothing here imports the embedded stack (:mod:`marlaas.stack`), the CLI or the SDK."""
