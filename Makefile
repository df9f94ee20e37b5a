# Entry points used by README, CI and developers. Every target sets up .venv first.
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo inspect test test-fast faults lint typecheck check bench bench-serving clean

setup:
	@bash scripts/setup.sh

# README's main job on the embedded default (no server to start by hand).
demo: setup
	@$(BIN)/hybridkv demo

inspect: setup
	@$(BIN)/hybridkv inspect gemma3-27b --hit-tokens 32768

# The whole test suite, slow end-to-end tests included. It ends with the slowest
# tests' times, so what makes the suite long stays in CI's log.
DURATIONS := --durations=25 --durations-min=1.0

test: setup
	@bash scripts/run_tests.sh $(DURATIONS)

# Skips tests marked slow.
test-fast: setup
	@bash scripts/run_tests.sh -m "not slow" $(DURATIONS)

# The abuse, isolation and fault suite; writes docs/RELIABILITY.md from what it saw.
FAULTS_DIR := build/faults
faults: setup
	@mkdir -p $(FAULTS_DIR) && rm -f $(FAULTS_DIR)/rows.jsonl
	@HYBRIDKV_FAULTS_REPORT=$$PWD/$(FAULTS_DIR)/rows.jsonl bash scripts/run_tests.sh tests/faults \
		tests/e2e/test_multihost_e2e.py tests/e2e/test_pool_full_e2e.py \
		--junitxml=$(FAULTS_DIR)/junit.xml -q; rc=$$?; \
	$(BIN)/python scripts/faults_report.py $(FAULTS_DIR)/rows.jsonl \
		--junit $(FAULTS_DIR)/junit.xml --out docs/RELIABILITY.md; exit $$rc

lint: setup
	@$(BIN)/ruff check . && $(BIN)/ruff format --check .

typecheck: setup
	@$(BIN)/mypy

check: lint typecheck

bench: setup
	@for b in benchmarks/bench_*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

# The serving workloads of README's Performance section, on Gemma 3 270M's shape.
bench-serving: setup
	@for w in multi-turn restart long-doc-qa shared; do \
		$(BIN)/hybridkv bench $$w --json bench-results/$$w.json --plot bench-results/$$w || exit 1; \
	done

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
