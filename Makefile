# Set-up and everyday commands. Every target creates .venv from pyproject.toml when it is missing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
CONFIG ?= config/reputd.yaml

.PHONY: run test lint bench clean stress

$(BIN)/reputd: pyproject.toml setup.py indexcore/_kernels.c
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
	$(BIN)/python bench/bench_suite.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

# The long mode of every stress-capable suite (the test files that import tests.stress, then bench/soak.py
# when present); each suite's figures are collected in stress-report.jsonl, printed at the end.
STRESS_REPORT := stress-report.jsonl
# suites with no long mode of their own whose cases the stress report lists too
STRESS_ALSO := tests/test_corruption_modes.py tests/test_hostile_input.py
stress: $(BIN)/reputd
	@rm -f $(STRESS_REPORT); status=0; \
	REPUTD_STRESS=1 REPUTD_STRESS_REPORT=$(STRESS_REPORT) $(BIN)/python -m pytest -q -s \
		$$(grep -l "tests.stress\|from tests import stress" tests/test_*.py) $(STRESS_ALSO) || status=1; \
	if test -f bench/soak.py; then \
		REPUTD_STRESS=1 REPUTD_STRESS_REPORT=$(STRESS_REPORT) $(BIN)/python bench/soak.py || status=1; \
	fi; \
	echo "--- $(STRESS_REPORT)"; cat $(STRESS_REPORT) 2>/dev/null; exit $$status
