# Two commands do everything: `make serve` and `make test`. Both build .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Without CUDA we take the CPU build of torch; pass TORCH_PIP_ARGS to point pip elsewhere.
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
PYTEST_ARGS ?=

.PHONY: install serve test test-slow clean-venv prometheus gpu-wheels

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

# Everything but the long variants (`slow`: the 10-minute soak, the full fuzz, ...); each
# has a short variant that runs here.
test: install prometheus
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

test-slow: install prometheus
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)

# The wheels the GPU machine lacks (pydantic and its needs), into .whl/: see the header of
# tests/gpu/run_device_checks.sh. Needs network; the GPU machine has none.
gpu-wheels:
	PYTHON=$(PYTHON) sh tests/gpu/fetch_wheels.sh
