# README command 1: `make serve`  (venv + models + a real tritonserver, cpu profile)
# README command 2: `make test`   (venv + checks + unit and real-server tests)

PYTHON ?= python3
VENV ?= .venv
STAMP := $(VENV)/.deps-stamp
PYTEST_ARGS ?=

.PHONY: serve test test-fast bench bench-sim bench-modes loadtest soak aiperf tools clean-venv

$(STAMP): pyproject.toml requirements/cpu-serve.txt requirements/test.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --upgrade --quiet pip
	$(VENV)/bin/python -m pip install -r requirements/cpu-serve.txt -r requirements/test.txt
	$(VENV)/bin/python -m pip install --no-deps -e .
	touch $@

serve: $(STAMP)
	$(VENV)/bin/specdec-serve

# This server against the peers in one run (specdec-compare --help): plain and
# assisted transformers generation (and prompt lookup on the copy-heavy set)
# in-process, then a running `make serve` plain, adaptive and fixed-window at
# 1, 2, 4 and 8 streams and at 150-, 300-, 750- and 2,000-token prompts, and each
# drafter alone; ratios in JSON, a markdown table and a PNG. About 50 minutes
# on a 2-vCPU machine. COMPARE_ARGS adds options.
BENCH_DIR ?= bench-results
COMPARE_ARGS ?=
bench: $(STAMP)
	$(VENV)/bin/specdec-compare --json $(BENCH_DIR)/compare.json --png $(BENCH_DIR)/compare.png \
		--markdown $(BENCH_DIR)/compare.md $(COMPARE_ARGS)

# The coordinator at GPU step times (specdec-sim-bench --help): starts a
# server with the sim profile (simulated engines that sleep a preset's forward
# times, SIM_PRESET), runs greedy requests plain and speculative at 1, 4, 16
# and 32 streams, and prints tokens/s, the speed-up beside the preset's ideal
# and the CPU time of tritonserver and the coordinator per round. A few minutes.
SIM_PRESET ?= h100-8b-1b
SIM_BENCH_ARGS ?=
bench-sim: $(STAMP)
	$(VENV)/bin/python -m tools.sim_bench --preset $(SIM_PRESET) --json $(BENCH_DIR)/sim.json $(SIM_BENCH_ARGS)

# Plain, adaptive and fixed-window speculative decoding per prompt, with the
# cost model's predictions, against a running `make serve` (specdec-bench
# --help); BENCH_ARGS may override the files.
BENCH_ARGS ?=
bench-modes: $(STAMP)
	$(VENV)/bin/specdec-bench --json $(BENCH_DIR)/bench.json --png $(BENCH_DIR)/bench.png $(BENCH_ARGS)

# Locust load test (loadtests/) against a running server (`make serve`): for
# each user count of LOADTEST_STEPS, LOADTEST_STEP_SECONDS with speculation on,
# then as long with it off; then it stops. Writes locust's CSV and HTML reports,
# the per-step table and a PNG plot into LOADTEST_DIR (under the ignored
# reports/); exits non-zero if any request failed. LOADTEST_ARGS: more options
# (--prompts-file, --temperature, --stream-ratio, --spec-window; loadtests/README.md).
LOADTEST_HOST ?= 127.0.0.1:8001
LOADTEST_STEPS ?= 1,2,4
LOADTEST_MODES ?= on,off
LOADTEST_STEP_SECONDS ?= 120
LOADTEST_MAX_TOKENS ?= 64
LOADTEST_DIR ?= reports/loadtest
LOADTEST_ARGS ?=
LOADTEST_STAMP := $(VENV)/.loadtest-stamp
$(LOADTEST_STAMP): $(STAMP) requirements/loadtest.txt
	$(VENV)/bin/python -m pip install -r requirements/loadtest.txt
	touch $@

loadtest: $(LOADTEST_STAMP)
	mkdir -p $(LOADTEST_DIR)
	$(VENV)/bin/locust -f loadtests/locustfile.py --headless --only-summary \
		--host $(LOADTEST_HOST) --steps $(LOADTEST_STEPS) --modes $(LOADTEST_MODES) \
		--step-seconds $(LOADTEST_STEP_SECONDS) --max-tokens $(LOADTEST_MAX_TOKENS) \
		--csv $(LOADTEST_DIR)/locust --html $(LOADTEST_DIR)/locust.html $(LOADTEST_ARGS)

# Soak test against a running server (`make serve`, on this machine so its
# processes' memory can be read): SOAK_USERS users for SOAK_SECONDS, then a
# report of errors and the RSS growth of tritonserver and its model stubs in
# SOAK_JSON; exits non-zero on any error or growth >= 10 % (specdec-soak --help).
SOAK_URL ?= 127.0.0.1:8001
SOAK_USERS ?= 4
SOAK_SECONDS ?= 600
SOAK_JSON ?= reports/soak/soak.json
SOAK_ARGS ?=
soak: $(STAMP)
	$(VENV)/bin/specdec-soak --url $(SOAK_URL) --users $(SOAK_USERS) --duration $(SOAK_SECONDS) \
		--json $(SOAK_JSON) $(SOAK_ARGS)

# NVIDIA AIPerf against a running server (`make serve`), speculation on and
# off (speculation_window 0) at each concurrency of AIPERF_CONCURRENCY, for
# each endpoint of AIPERF_ENDPOINTS: template (Triton's generate_stream at
# AIPERF_URL), chat and completions (the OpenAI-compatible frontend at
# AIPERF_OPENAI_URL); AIPERF_REQUESTS requests per run. Writes every run's
# AIPerf artifacts and the side-by-side table (markdown + JSON) into
# AIPERF_DIR; exits non-zero if any request failed (specdec-aiperf --help).
# AIPerf lives in its own virtualenv (requirements/aiperf.txt says why).
# AIPERF_ARGS: more specdec-aiperf options; after `--`, options for aiperf itself.
AIPERF_VENV ?= .venv-aiperf
AIPERF_STAMP := $(AIPERF_VENV)/.deps-stamp
AIPERF_URL ?= http://127.0.0.1:8000
AIPERF_OPENAI_URL ?= http://127.0.0.1:9000
AIPERF_ENDPOINTS ?= template,chat,completions
AIPERF_CONCURRENCY ?= 1,2,4
AIPERF_REQUESTS ?= 8
AIPERF_OUTPUT_TOKENS ?= 64
AIPERF_DIR ?= reports/aiperf
AIPERF_ARGS ?=
$(AIPERF_STAMP): requirements/aiperf.txt
	$(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/python -m pip install --upgrade --quiet pip
	$(AIPERF_VENV)/bin/python -m pip install -r requirements/aiperf.txt
	touch $@

aiperf: $(STAMP) $(AIPERF_STAMP)
	$(VENV)/bin/specdec-aiperf --aiperf $(AIPERF_VENV)/bin/aiperf --url $(AIPERF_URL) \
		--openai-url $(AIPERF_OPENAI_URL) --endpoints $(AIPERF_ENDPOINTS) --concurrency $(AIPERF_CONCURRENCY) \
		--requests $(AIPERF_REQUESTS) --output-tokens $(AIPERF_OUTPUT_TOKENS) --out $(AIPERF_DIR) $(AIPERF_ARGS)

# Lint/check tools that are not Python packages (installed idempotently).
tools:
	@for script in .ci/tools/install-*.sh; do \
		[ -e "$$script" ] || continue; \
		bash "$$script" || exit 1; \
	done

# The virtualenvs and tools install side by side (each is mostly downloads
# and unpacking, one core each); then pytest in two runs. The fast tests need
# no server and are CPU-bound Python, so they run on every core
# (pytest-xdist, at most FAST_WORKERS processes). The slow ones run one at a
# time after them: each shares the cores with the real server it talks to,
# and some judge its timing (draft deadlines, recovery times). Exit status 5
# (nothing collected, e.g. PYTEST_ARGS="-k ..." selecting one kind) is fine.
FAST_WORKERS ?= 4
PYTEST_FAST = $(VENV)/bin/python -m pytest -m "not slow" -n logical --maxprocesses=$(FAST_WORKERS) $(PYTEST_ARGS)
test:
	$(MAKE) --jobs=3 --output-sync=target $(STAMP) $(AIPERF_STAMP) tools
	$(PYTEST_FAST) || [ $$? -eq 5 ]
	$(VENV)/bin/python -m pytest -m slow $(PYTEST_ARGS) || [ $$? -eq 5 ]

# Unit tests and offline checks only (no model download, no server).
test-fast: $(STAMP) tools
	$(PYTEST_FAST)

clean-venv:
	rm -rf $(VENV)
