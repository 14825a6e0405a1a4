# The two commands in the README. Both bootstrap .venv first (idempotent, fast when unchanged).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: run test bootstrap calibrate clean

bootstrap:
	@scripts/bootstrap.sh

run: bootstrap
	@echo "Starting the reference server on the embedded SmolLM2 model at http://127.0.0.1:30000"
	@echo "Try:  curl -s localhost:30000/generate -d '{\"text\": \"The capital of France is\", \"sampling_params\": {\"temperature\": 0, \"max_new_tokens\": 16}}'"
	@echo "Stop with Ctrl-C."
	@$(VENV)/bin/engy-node serve --model smollm2-135m --port 30000

test: bootstrap
	@$(PY) -m pytest -q $(PYTEST_ARGS)

calibrate: bootstrap
	@$(VENV)/bin/engy-node calibrate

clean:
	rm -rf $(VENV) .pytest_cache
