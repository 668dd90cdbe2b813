#!/bin/sh
# The local stand-in for `python:3.11-slim` where Docker Hub is out of reach: Debian bookworm
# (minbase, from Debian's own mirror) with Debian's Python 3.11, imported as IMAGE. Skipped when
# IMAGE exists. Needs root, debootstrap and podman.
set -eu
IMAGE=${1:-localhost/marlaas-base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
if podman image exists "$IMAGE"; then
    exit 0
fi
root=$(mktemp -d /var/tmp/marlaas-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
echo "build-base: debootstrap bookworm into $root (about 30 s)"
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$root" "$MIRROR" >"$root.log" 2>&1 || { tail -20 "$root.log" >&2; exit 1; }
rm -f "$root.log"
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" -c . | podman import --change 'CMD ["/bin/bash"]' - "$IMAGE" >/dev/null
echo "build-base: $IMAGE ($(podman image inspect "$IMAGE" --format '{{.Size}}') bytes)"
