# Entry points used by README, CI and developers. Every target sets up .venv first.
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo inspect test test-fast lint typecheck check bench bench-serving clean

setup:
	@bash scripts/setup.sh

# README's main job on the embedded default (no server to start by hand).
demo: setup
	@$(BIN)/hybridkv demo

inspect: setup
	@$(BIN)/hybridkv inspect gemma3-27b --hit-tokens 32768

# The whole test suite, slow end-to-end tests included.
test: setup
	@bash scripts/run_tests.sh

# Skips tests marked slow.
test-fast: setup
	@bash scripts/run_tests.sh -m "not slow"

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
