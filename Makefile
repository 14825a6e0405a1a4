# The two commands in the README. Both bootstrap .venv first (idempotent, fast when unchanged).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: run test bootstrap calibrate clean

bootstrap:
	@scripts/bootstrap.sh

run: bootstrap
	@$(VENV)/bin/engy-tui --local --traffic

test: bootstrap
	@$(PY) -m pytest -q $(PYTEST_ARGS)

calibrate: bootstrap
	@$(VENV)/bin/engy-node calibrate

clean:
	rm -rf $(VENV) .pytest_cache
