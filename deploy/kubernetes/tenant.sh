#!/usr/bin/env bash
# `marlaas tenant ...` on Kubernetes (docs/kubernetes.md), in place of compose's `admin` service
# and its `kill -s HUP nats`:
#   deploy/kubernetes/tenant.sh add acme --json     # prints its token, once
#   deploy/kubernetes/tenant.sh revoke acme
#   deploy/kubernetes/tenant.sh list
# The command runs in the manager's pod, as the services user; add, revoke and sync re-render the
# broker's users (auth.conf: bcrypt hashes only), which this stores in Secret marlaas-nats-auth.
# Each NATS pod's auth-reload container takes the new file once the kubelet has synced the
# Secret (a minute or two) and reloads nats-server. MARLAAS_NAMESPACE: the namespace (marlaas).
set -euo pipefail
ns=${MARLAAS_NAMESPACE:-marlaas}
rendered=/tmp/auth.conf  # in the manager's pod
kubectl -n "$ns" exec deploy/manager -- marlaas tenant "$@" --auth-file "$rendered"
case "${1:-}" in
    add | revoke | sync)
        kubectl -n "$ns" exec deploy/manager -- cat "$rendered" |
            kubectl -n "$ns" create secret generic marlaas-nats-auth --from-file=auth.conf=/dev/stdin \
                --dry-run=client -o yaml |
            kubectl -n "$ns" apply -f - >/dev/null
        echo "tenant.sh: Secret marlaas-nats-auth updated; NATS takes it within a minute or two" >&2
        ;;
esac
