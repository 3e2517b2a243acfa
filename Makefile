# Two commands: `make demo` and `make test`. Each creates .venv when missing.
# `make ci` is what .ci/run runs: lint, types, the suite with doctests, the docs, the floor.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PYTEST := $(BIN)/python -m pytest -q -n 2

.PHONY: demo test test-fast lint typecheck docs ci bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet -e ".[demo]"
	touch $@

$(VENV)/.installed-test: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $@ $(VENV)/.installed

$(VENV)/.installed-dev: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet -e ".[test,docs,lint]"
	touch $@ $(VENV)/.installed-test $(VENV)/.installed

demo: $(VENV)/.installed
	$(BIN)/memwise demo

# The whole suite and every docstring example.
test: $(VENV)/.installed-test
	$(PYTEST) --doctest-modules src/memwise tests

# Development lane: no `slow` tests, no doctests.
test-fast: $(VENV)/.installed-test
	$(PYTEST) -m "not slow" tests

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(VENV)/.installed-dev
	$(BIN)/mypy

docs: $(VENV)/.installed-dev
	$(BIN)/mkdocs build --strict

ci: lint typecheck test docs

bench: $(VENV)/.installed-test
	$(BIN)/memwise bench

clean:
	rm -rf $(VENV) build site src/*.egg-info
