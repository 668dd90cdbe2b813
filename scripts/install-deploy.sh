#!/bin/sh
# What `make deploy-test` needs beyond the project's venv, installed where missing (root + apt-get):
# podman with runc (crun refuses this kind of host's hybrid cgroups), netavark and aardvark-dns
# (bridge networks with name resolution), iptables (netavark's), debootstrap (the local base image).
# And podman's settings for such hosts, as a drop-in that leaves the rest of containers.conf alone:
# no default ulimits (podman's nofile default is above some hosts' hard limit), no pids limit.
set -eu
need=""
for pair in podman:podman runc:runc debootstrap:debootstrap iptables:iptables \
            /usr/lib/podman/netavark:netavark /usr/lib/podman/aardvark-dns:aardvark-dns; do
    cmd=${pair%%:*} pkg=${pair#*:}
    command -v "$cmd" >/dev/null 2>&1 || [ -x "$cmd" ] || need="$need $pkg"
done
if [ -n "$need" ]; then
    if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        echo "install-deploy: missing:$need (needs root and apt-get to install)" >&2
        exit 1
    fi
    echo "install-deploy: installing$need"
    # shellcheck disable=SC2086
    "$(dirname "$0")/apt-install.sh" $need
fi
dropin=/etc/containers/containers.conf.d/50-marlaas-deploy-test.conf
if [ ! -f "$dropin" ]; then
    mkdir -p "$(dirname "$dropin")"
    cat >"$dropin" <<'CONF'
# written by marlaas's scripts/install-deploy.sh (make deploy-test)
[containers]
default_ulimits = []
pids_limit = 0
[engine]
runtime = "runc"
[network]
network_backend = "netavark"
CONF
    echo "install-deploy: wrote $dropin"
fi
