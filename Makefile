# Two commands do everything: `make serve` and `make test`. Both build .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Without CUDA we take the CPU build of torch; pass TORCH_PIP_ARGS to point pip elsewhere.
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
PYTEST_ARGS ?=

.PHONY: install serve test test-slow clean-venv prometheus gpu-wheels config-docs bench-correctness

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

serve: install
	$(VENV)/bin/hybridserve serve

# Debian's prometheus, for tests/observability (idempotent; explains and skips without root).
prometheus:
	@sh deploy/prometheus/install.sh

# Lint and format check first (`ruff check .`, `ruff format --check .`; pyproject.toml),
# then everything but the long variants (`slow`: the 10-minute soak, the full fuzz, ...);
# each has a short variant that runs here. In two parts: the in-process tests on
# TEST_WORKERS pytest-xdist workers (each runs torch on one thread, so two workers use both
# cores; a module stays on one worker, its module fixtures built once), then the tests that
# share the session's Ray cluster and time its answers, in one process.
TEST_WORKERS ?= 2
SERIAL_TESTS := tests/e2e tests/observability tests/reliability
test: install prometheus
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadscope $(addprefix --ignore ,$(SERIAL_TESTS)) $(PYTEST_ARGS)
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS) $(SERIAL_TESTS)

test-slow: install prometheus
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)

# `hybridserve bench correctness` against two local servers of CORRECTNESS_MODEL: the tested one
# on port 8000 with everything on (prefix cache, MTP k=3, overlap, tight pools, the host tier),
# the reference on 8001 with cache, speculation and overlap off. Logs in $TMPDIR; both stop at the end.
CORRECTNESS_MODEL ?= configs/models/qwen3-next-tiny-py
CORRECTNESS_INTERVAL ?= 64
CORRECTNESS_TESTED ?= --set spec.method=mtp --set spec.num_draft_tokens=3 --set scheduler.overlap=true \
	--set cache.mamba_track_interval=$(CORRECTNESS_INTERVAL) --set cache.max_mamba_slots=48 \
	--set cache.max_kv_tokens=8192 --set cache.host_mamba_slots=64 --set cache.host_kv_tokens=16384
CORRECTNESS_REFERENCE ?= --set cache.enable_prefix_cache=false --set spec.method=none --set scheduler.overlap=false
CORRECTNESS_ARGS ?= --concurrency 64 --requests 5000
bench-correctness: install
	@set -e; logs=$${TMPDIR:-/tmp}/hybridserve-correctness; mkdir -p $$logs; \
	$(VENV)/bin/hybridserve serve $(CORRECTNESS_MODEL) --port 8000 --app-name correctness-tested \
		--set metrics.port=9465 $(CORRECTNESS_TESTED) >$$logs/tested.log 2>&1 & t=$$!; \
	$(VENV)/bin/hybridserve serve $(CORRECTNESS_MODEL) --port 8001 --app-name correctness-reference \
		--set metrics.port=9466 $(CORRECTNESS_REFERENCE) >$$logs/reference.log 2>&1 & r=$$!; \
	trap 'kill $$t $$r 2>/dev/null; wait' EXIT; \
	for p in 8000 8001; do until curl -sf http://127.0.0.1:$$p/health >/dev/null; do \
		kill -0 $$t && kill -0 $$r || { echo "a server exited: see $$logs"; exit 1; }; sleep 2; done; done; \
	$(VENV)/bin/hybridserve bench correctness --url http://127.0.0.1:8000 --reference-url http://127.0.0.1:8001 \
		--track-interval $(CORRECTNESS_INTERVAL) $(CORRECTNESS_ARGS)

# docs/configuration.md from configs/schema.py (tests/configs/test_reference.py checks it).
config-docs: install
	$(PY) -m configs.reference

# The wheels the GPU machine lacks (pydantic and its needs), into .whl/: see the header of
# tests/gpu/run_device_checks.sh. Needs network; the GPU machine has none.
gpu-wheels:
	PYTHON=$(PYTHON) sh tests/gpu/fetch_wheels.sh
