# Two commands do everything: `make serve` and `make test`. Both build .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Without CUDA we take the CPU build of torch; pass TORCH_PIP_ARGS to point pip elsewhere.
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
PYTEST_ARGS ?=

.PHONY: install serve test test-slow clean-venv prometheus gpu-wheels config-docs

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

# docs/configuration.md from configs/schema.py (tests/configs/test_reference.py checks it).
config-docs: install
	$(PY) -m configs.reference

# The wheels the GPU machine lacks (pydantic and its needs), into .whl/: see the header of
# tests/gpu/run_device_checks.sh. Needs network; the GPU machine has none.
gpu-wheels:
	PYTHON=$(PYTHON) sh tests/gpu/fetch_wheels.sh
