# Two commands: `make demo` and `make test`. Each creates .venv when missing.
# `make ci` is what .ci/run runs: lint, types, the suite with doctests, the docs, the floor.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PYTEST := $(BIN)/python -m pytest -q -n 2

.PHONY: demo test test-fast lint typecheck docs floor ci bench clean

# The oldest JAX release memwise supports: the floor declared in pyproject.toml.
JAX_FLOOR := $(shell sed -n 's/.*"jax>=\([0-9.]*\)".*/\1/p' pyproject.toml)
FLOOR_VENV := .venv-floor

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
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The fast lane on exactly the floor release of jax and jaxlib.
$(FLOOR_VENV)/.installed-$(JAX_FLOOR): pyproject.toml
	rm -rf $(FLOOR_VENV)
	$(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(FLOOR_VENV)/bin/python -m pip install --quiet "jax==$(JAX_FLOOR)" "jaxlib==$(JAX_FLOOR)" -e ".[test]"
	touch $@

floor: $(FLOOR_VENV)/.installed-$(JAX_FLOOR)
	$(FLOOR_VENV)/bin/python -c "import jax; assert jax.__version__ == '$(JAX_FLOOR)', jax.__version__"
	$(FLOOR_VENV)/bin/python -m pytest -q -n 2 -m "not slow" -p no:cacheprovider tests

ci: lint typecheck test docs floor

bench: $(VENV)/.installed-test
	$(BIN)/memwise bench

clean:
	rm -rf $(VENV) $(FLOOR_VENV) build site src/*.egg-info
