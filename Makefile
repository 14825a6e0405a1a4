# The two commands in the README. Both bootstrap .venv first (idempotent, fast when unchanged).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: run test lint format lock bootstrap calibrate clean

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
