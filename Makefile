# Set-up and everyday commands. Every target creates .venv from pyproject.toml when it is missing:
# `make run` with the daemon's own dependencies only, every other target with the test and backfill
# extras too (PySpark alone is ~490 MB, which trying the daemon does not need).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
CONFIG ?= config/reputd.yaml
# The package's bytecode is compiled after installing: an environment with PYTHONDONTWRITEBYTECODE would
# otherwise compile it again in every process (felt by `reputd query`).
INSTALL = $(BIN)/pip install --quiet -e
COMPILE = $(BIN)/python -m compileall -q daemon indexcore
DEPS    := pyproject.toml setup.py indexcore/_kernels.c indexcore/_spans.c

.PHONY: run test lint docs bench clean stress

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# the daemon only: runtime dependencies and the C extension
$(VENV)/.installed-run: $(BIN)/python $(DEPS)
	$(INSTALL) .
	$(COMPILE)
	touch $@

# the daemon with the test and backfill extras (a superset of the above)
$(VENV)/.installed-test: $(BIN)/python $(DEPS)
	$(INSTALL) '.[test,backfill]'
	$(COMPILE)
	touch $@ $(VENV)/.installed-run

run: $(VENV)/.installed-run
	$(BIN)/python -m daemon.commands.sample_store --config $(CONFIG)
	$(BIN)/reputd run --config $(CONFIG)

# docs/ built strictly (a broken link or anchor fails) into a temporary directory, so nothing is written into
# the tree; not with --quiet, which hides the warnings that --strict counts. `mkdocs serve` shows them.
DOCS_BUILD = site=$$(mktemp -d) && { $(BIN)/mkdocs build --strict --site-dir "$$site"; status=$$?; \
	rm -rf "$$site"; exit $$status; }

# .ci/system-tools: the command-line tools some tests run, installed when this runs as root with apt-get
# (elsewhere those tests skip, saying why; with CI=true a missing one fails)
test: $(VENV)/.installed-test
	.ci/system-tools --install
	$(BIN)/ruff check .
	$(DOCS_BUILD)
	$(BIN)/python -m pytest -q

docs: $(VENV)/.installed-test
	$(DOCS_BUILD)

lint: $(VENV)/.installed-test
	$(BIN)/ruff check .

bench: $(VENV)/.installed-test
	$(COMPILE)
	$(BIN)/python bench/bench_suite.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

# The long mode of every stress-capable suite (the test files that import tests.stress, then bench/soak.py
# and the accelerated life, bench/life.py: REPUTD_LIFE_SECONDS, default 240); each suite's figures are
# collected in stress-report.jsonl, printed at the end.
STRESS_REPORT := stress-report.jsonl
# suites with no long mode of their own whose cases the stress report lists too
STRESS_ALSO := tests/test_corruption_modes.py tests/test_hostile_input.py
stress: $(VENV)/.installed-test
	@rm -f $(STRESS_REPORT); status=0; \
	REPUTD_STRESS=1 REPUTD_STRESS_REPORT=$(STRESS_REPORT) $(BIN)/python -m pytest -q -s \
		$$(grep -l "tests.stress\|from tests import stress" tests/test_*.py) $(STRESS_ALSO) || status=1; \
	if test -f bench/soak.py; then \
		REPUTD_STRESS=1 REPUTD_STRESS_REPORT=$(STRESS_REPORT) $(BIN)/python bench/soak.py || status=1; \
	fi; \
	REPUTD_STRESS=1 REPUTD_STRESS_REPORT=$(STRESS_REPORT) $(BIN)/python bench/life.py || status=1; \
	echo "--- $(STRESS_REPORT)"; cat $(STRESS_REPORT) 2>/dev/null; exit $$status
