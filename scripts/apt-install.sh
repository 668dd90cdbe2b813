#!/bin/sh
# Install the Debian packages named, quietly, updating the package lists only if the first try fails.
# Waits up to 10 minutes for apt's lock rather than failing while another install holds it.
set -eu
export DEBIAN_FRONTEND=noninteractive
apt() { apt-get -o DPkg::Lock::Timeout=600 "$@"; }
apt install -y -q --no-install-recommends "$@" >/dev/null 2>&1 \
    || { apt update -q >/dev/null && apt install -y -q --no-install-recommends "$@" >/dev/null; }
