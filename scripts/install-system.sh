#!/bin/sh
# System packages marlaas needs beyond pip, installed where missing and possible (root + apt-get):
# bubblewrap (`bwrap`), the python tool's sandbox. Without it env does not serve `python` unless
# the operator sets env.python_isolation = "none".
set -eu
if command -v bwrap >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install-system: bubblewrap (bwrap) is missing and cannot be installed here (needs root and" \
         "apt-get): install the package bubblewrap, or env will not serve the python tool" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q --no-install-recommends bubblewrap >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends bubblewrap >/dev/null; }
command -v bwrap >/dev/null && echo "install-system: installed bubblewrap ($(bwrap --version))"
