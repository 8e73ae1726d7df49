# README command 1: `make serve`  (venv + models + a real tritonserver, cpu profile)
# README command 2: `make test`   (venv + checks + unit and real-server tests)

PYTHON ?= python3
VENV ?= .venv
STAMP := $(VENV)/.deps-stamp
PYTEST_ARGS ?=

.PHONY: serve test test-fast bench tools clean-venv

$(STAMP): pyproject.toml requirements/cpu-serve.txt requirements/test.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --upgrade --quiet pip
	$(VENV)/bin/python -m pip install -r requirements/cpu-serve.txt -r requirements/test.txt
	$(VENV)/bin/python -m pip install --no-deps -e .
	touch $@

serve: $(STAMP)
	$(VENV)/bin/specdec-serve

# Plain, adaptive and fixed-window speculative decoding side by side against a
# running `make serve` (specdec-bench --help); BENCH_ARGS may override the files.
BENCH_ARGS ?=
BENCH_DIR ?= bench-results
bench: $(STAMP)
	$(VENV)/bin/specdec-bench --json $(BENCH_DIR)/bench.json --png $(BENCH_DIR)/bench.png $(BENCH_ARGS)

# Lint/check tools that are not Python packages (installed idempotently).
tools:
	@for script in .ci/tools/install-*.sh; do \
		[ -e "$$script" ] || continue; \
		bash "$$script" || exit 1; \
	done

test: $(STAMP) tools
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

# Unit tests and offline checks only (no model download, no server).
test-fast: $(STAMP) tools
	$(VENV)/bin/python -m pytest -m "not slow" $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
