# The two commands in the README. Both bootstrap .venv first (idempotent, fast when unchanged).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: run test lint format bootstrap calibrate clean

bootstrap:
	@scripts/bootstrap.sh

run: bootstrap
	@$(VENV)/bin/engy-tui --local --traffic

test: bootstrap
	@$(PY) -m pytest -q $(PYTEST_ARGS)

# Lint and format check (ruff). CI runs it before the tests.
lint: bootstrap
	@$(VENV)/bin/ruff check .
	@$(VENV)/bin/ruff format --check .

format: bootstrap
	@$(VENV)/bin/ruff check --fix .
	@$(VENV)/bin/ruff format .

calibrate: bootstrap
	@$(VENV)/bin/engy-node calibrate

clean:
	rm -rf $(VENV) .pytest_cache
