# The two commands in the README. Both bootstrap .venv first (idempotent, fast when unchanged).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# Test processes (pytest-xdist): four, even on two cores — a fifth of a test's time is spent
# waiting on servers it started, so two workers left the CPUs idle (3,835 tests: 13 min 20 s with
# four, 16 min 8 s with two, 2 cores); each worker may load the model and start servers of its
# own, so not more. `make test PYTEST_WORKERS=0` runs in this process alone.
# Each worker takes whole modules (a module-scoped fixture is built once), in collection order,
# which tests/conftest.py starts with the modules whose tests run for minutes: 4,354 tests in
# 15 min 56 s and 16 min 25 s on 2 cores, against 19 min 8–15 s with tests handed out one by one
# in file order, which left a long test or two running alone at the end.
PYTEST_WORKERS ?= 4

.PHONY: run test lint format lock bootstrap calibrate clean

bootstrap:
	@scripts/bootstrap.sh

run: bootstrap
	@$(VENV)/bin/engy-tui --local --traffic

test: bootstrap
	@$(PY) -m pytest -q --numprocesses $(PYTEST_WORKERS) --maxprocesses 4 --dist loadscope --no-loadscope-reorder $(PYTEST_ARGS)

# Lint, format and type checks (ruff, mypy). CI runs them before the tests.
lint: bootstrap
	@$(VENV)/bin/ruff check .
	@$(VENV)/bin/ruff format --check .
	@$(VENV)/bin/mypy

format: bootstrap
	@$(VENV)/bin/ruff check --fix .
	@$(VENV)/bin/ruff format .

# Upgrade every dependency within pyproject.toml's bounds (torch and toploc stay as bootstrap
# built them) and rewrite requirements.lock; run `make test` before committing the new lock.
lock: bootstrap
	@$(PY) -c "from importlib.metadata import version as v; print(f'torch=={v(\"torch\")}\ntoploc=={v(\"toploc\")}')" > $(VENV)/keep.txt
	@$(PY) -m pip install -q -U --upgrade-strategy eager -c $(VENV)/keep.txt -e ".[all,test,lint]"
	@$(PY) scripts/lock.py

calibrate: bootstrap
	@$(VENV)/bin/engy-node calibrate

clean:
	rm -rf $(VENV) .pytest_cache
