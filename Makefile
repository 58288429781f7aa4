# Crucible: one venv, built from nothing. Override TORCH_SPEC for a GPU build, e.g.
#   make install TORCH_SPEC="torch==2.13.0 --index-url <your CUDA wheel index>"
PYTHON ?= python3.11
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
# the tests run in parallel processes (pytest-xdist), a test file to a process so that its
# module fixtures start once; TEST_WORKERS=1 runs them in this process, one after another
TEST_WORKERS ?= 2
XDIST := $(if $(filter 1,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)
STAMP := $(VENV)/.installed

.PHONY: install demo test test-unit test-slow test-all lint system-deps corpus clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_SPEC)
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	$(BIN)/python -m crucible.corpus fetch
	touch $(STAMP)

install: $(STAMP)

# System packages the tests need (root on Debian): Chromium for browser tests,
# the PostgreSQL server binaries for the throwaway test cluster.
system-deps:
	bash infra/system-deps.sh

corpus: $(STAMP)
	$(BIN)/python -m crucible.corpus fetch

demo: install
	$(BIN)/crucible sweep --demo

# every test this machine can run: first the system packages (infra/system-deps.sh), installed
# when missing as root on Debian (seconds when present); elsewhere it installs nothing and says
# how many tests will skip without them and the one command that enables them
TEST_DEPS := bash infra/system-deps.sh --or-explain $(BIN)/python

test: install
	@$(TEST_DEPS) "not slow"
	$(BIN)/python -m pytest $(XDIST) -m "not slow" -q

# the fast lane: tests/unit only (no Postgres, no S3 server, no Prefect, no browser)
test-unit: install
	$(BIN)/python -m pytest $(XDIST) -m "unit and not slow" -q

test-slow: install
	@$(TEST_DEPS) "slow"
	$(BIN)/python -m pytest $(XDIST) -m "slow" -q

test-all: install
	@$(TEST_DEPS)
	$(BIN)/python -m pytest $(XDIST) -q

lint: install
	$(BIN)/ruff check crucible cli flows api db dashboards tests benchmarks infra

clean:
	rm -rf $(VENV) .pytest_cache
