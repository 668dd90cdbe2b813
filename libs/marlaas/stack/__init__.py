"""The embedded stack that ``marlaas up`` runs: the launcher, the embedded nats-server and the
broker's ``auth.conf`` rendered from the tenants, and the operator's ``marlaas tenant`` commands."""
