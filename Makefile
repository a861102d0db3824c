# Set-up and everyday commands. Every target creates .venv from pyproject.toml when it is missing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
CONFIG ?= config/reputd.yaml

.PHONY: run test lint bench clean

$(BIN)/reputd: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

run: $(BIN)/reputd
	$(BIN)/python -m daemon.sample_store --config $(CONFIG)
	$(BIN)/reputd run --config $(CONFIG)

test: $(BIN)/reputd
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

lint: $(BIN)/reputd
	$(BIN)/ruff check .

bench: $(BIN)/reputd
	$(BIN)/python bench/bench_live.py
	$(BIN)/python bench/bench_backfill.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
