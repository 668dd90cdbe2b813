#!/bin/bash
# The broker's users in a NATS pod (statefulset.yaml), as compose's nats-auth-init and
# `docker compose kill -s HUP nats` handle them; run by the marlaas image (it has `marlaas` and
# nats-server):
#   init   before nats-server starts: auth.conf from Secret marlaas-nats-auth, which holds what
#          `marlaas tenant` last rendered (deploy/kubernetes/tenant.sh stores it there), with the
#          services password now configured; an empty or absent Secret gives the services and
#          sandbox users alone (`marlaas tenant init-auth`), as on compose's first start
#   watch  beside nats-server: when the Secret's auth.conf changes, the same, then nats-server
#          reloads its users twice (NATS 2.15 wires a new account to the platform's services only
#          on the reload after the one adding it; libs/marlaas/stack/broker_auth.py)
# A file nats-server refuses (`nats-server -t`) is not taken: the users stay as they were.
set -euo pipefail
secret=${NATS_AUTH_SECRET:-/etc/nats/auth-secret/auth.conf}
auth=${NATS_AUTH_FILE:-/etc/nats/auth/auth.conf}
pid_file=${NATS_PID_FILE:-/var/run/nats/nats.pid}
every_s=${NATS_AUTH_EVERY_S:-5}
reload_gap_s=${NATS_RELOAD_GAP_S:-2}

fingerprint() {
    if [ -e "$secret" ]; then sha256sum <"$secret"; else echo absent; fi
}

# auth.conf from the Secret (or the services user alone), checked; `.taken` records which Secret
# content it was, for `watch` (a restarted watcher, or a change between init and watch, is seen)
take() {
    local dir found
    dir=$(dirname "$auth")
    found=$(fingerprint)
    if [ ! -s "$secret" ]; then
        marlaas tenant init-auth --auth-file "$auth" || return 1
    else
        cp "$secret" "$dir/.incoming.conf" || return 1
        marlaas tenant init-auth --auth-file "$dir/.incoming.conf" || return 1
        printf 'include ".incoming.conf"\n' >"$dir/.check.conf" || return 1
        if ! nats-server -c "$dir/.check.conf" -t; then
            rm -f "$dir/.incoming.conf" "$dir/.check.conf"
            echo "$found" >"$dir/.taken"  # reported once, not every round
            echo "nats-auth: nats-server refuses $secret; the users stay as they were" >&2
            return 1
        fi
        rm -f "$dir/.check.conf"
        mv "$dir/.incoming.conf" "$auth" || return 1
    fi
    echo "$found" >"$dir/.taken"
}

reload() {
    local pid
    [ -s "$pid_file" ] || return 0  # not started yet: it reads the new file when it starts
    pid=$(cat "$pid_file")
    kill -HUP "$pid" && sleep "$reload_gap_s" && kill -HUP "$pid" || return 1
    echo "nats-auth: nats-server $pid reloaded its users"
}

case "${1:-}" in
    init)
        take
        ;;
    watch)
        while sleep "$every_s"; do
            [ "$(fingerprint)" = "$(cat "$(dirname "$auth")/.taken" 2>/dev/null)" ] && continue
            if take; then reload || echo "nats-auth: could not reload nats-server" >&2; fi
        done
        ;;
    *)
        echo "usage: $0 init|watch" >&2
        exit 2
        ;;
esac
