# Two commands: `make demo` and `make test`. Each creates .venv when missing.
# `make ci` is what .ci/run runs: lint, types, the suite with doctests, the docs, the floor,
# the fast lane under JAX's next custom_vjp and remat.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# worksteal: a worker that runs out of tests takes the other's, so one long test at the
# end of a run does not leave a core idle.
PYTEST := $(BIN)/python -m pytest -q -n 2 --dist worksteal

.PHONY: demo test test-full test-accelerator durations test-fast test-next-jax lint typecheck docs floor floor-venv ci bench bench-peers clean

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

# The whole suite and every docstring example, in four runs with fresh worker processes
# each: XLA:CPU has crashed after about 840 compilations in one process (Diffrax's
# adjoint tests, about a hundred compilations of their own, crashed a worker of the first).
# The conformance grids (tests marked `grid`: the matrix, the ported neural-tangents and
# Diffrax tests) run a stratified sample, and of the other `slow` tests 6% of each
# file's on average (at least one where the file has no other test), chosen by a seed the
# header prints (tests/_grid.py): every file runs, every slow test runs in some runs.
# `make test-full` runs every test and case.
PORTED := $(wildcard tests/test_nt_ported_*.py)
OWN_PROCESS := tests/test_matrix.py tests/test_diffrax_adjoint.py $(PORTED)
test: $(VENV)/.installed-test
	rm -f build/test-results*.xml
	$(PYTEST) --doctest-modules --junitxml=build/test-results-1.xml src/memwise tests \
		$(addprefix --ignore=,$(OWN_PROCESS))
	$(PYTEST) --junitxml=build/test-results-2.xml tests/test_matrix.py
	$(PYTEST) --junitxml=build/test-results-3.xml $(PORTED)
	$(PYTEST) --junitxml=build/test-results-4.xml tests/test_diffrax_adjoint.py

test-full:
	MEMWISE_TEST_GRID=full $(MAKE) test

# The fast lane and the backends' kernel tests on the first accelerator JAX finds, in one
# process (one program holds a TPU at a time). Comparisons use the backend's tolerances
# (tests/_close.py); memory assertions state the backend they are about.
ACCELERATOR_TESTS := tests/test_sdpa_jax.py tests/test_engine.py tests/test_pairwise.py \
	tests/test_vjp.py tests/test_cross_entropy.py tests/test_chunked.py tests/test_accumulate.py \
	tests/test_kernels.py tests/test_cross_entropy_kernel.py tests/test_pairwise_kernel.py \
	tests/test_pair_function_kernel.py tests/test_scan_offload.py
test-accelerator: $(VENV)/.installed-test
	$(BIN)/python -c 'import jax, sys; sys.exit(0 if jax.default_backend() != "cpu" else "test-accelerator: JAX finds no accelerator (jax.devices() is CPU)")'
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not slow" $(ACCELERATOR_TESTS)

# tests/DURATIONS.md from the last `make test` (per-file totals, the slowest tests).
durations:
	@[ -f build/test-results-1.xml ] || $(MAKE) test
	$(BIN)/python tests/_durations.py

# Development lane: no `slow` tests, no doctests.
test-fast: $(VENV)/.installed-test
	$(PYTEST) -m "not slow" tests

# The fast lane under the reimplementations JAX is moving to (custom_vjp and remat, each
# behind a flag), so the release that turns them on by default changes nothing here. A
# flag the installed jax does not have is reported and left out; none: the lane skips.
# Every file, not only those that call a custom_vjp or checkpoint: counted per test
# (2026-12-06), the files whose fast-lane tests call neither hold 73 s of the lane's
# 557 s, and a list of them would go stale without a test noticing; after `make test`
# most of the lane is compilation-cache hits (the flags leave most programs' HLO as it
# was, and the cache key does not include JAX's flags).
NEXT_JAX_FLAGS := jax_custom_vjp3 jax_remat3

test-next-jax: $(VENV)/.installed-test
	@flags=$$($(BIN)/python -c 'import sys, jax; have = [f for f in sys.argv[1:] if hasattr(jax.config, f)]; [print(f"test-next-jax: jax {jax.__version__} has no flag {f}, left out", file=sys.stderr) for f in sys.argv[1:] if f not in have]; print(" ".join(f.upper() + "=true" for f in have))' $(NEXT_JAX_FLAGS)) && \
	if [ -z "$$flags" ]; then echo "test-next-jax: skipped (none of $(NEXT_JAX_FLAGS) exists in this jax)"; \
	else echo "test-next-jax: $$flags" && \
	env $$flags $(BIN)/python -c 'import sys, jax; on = [f for f in sys.argv[1:] if getattr(jax.config, f, None) is False]; sys.exit(f"test-next-jax: {on} not turned on by the environment" if on else 0)' $(NEXT_JAX_FLAGS) && \
	env $$flags $(PYTEST) -m "not slow" -p no:cacheprovider tests; fi

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

# When the floor is the release .venv has, `make test` ran on it already: skipped.
floor: $(VENV)/.installed-test
	@if $(BIN)/python -c "import sys, jax, jaxlib; sys.exit(0 if jax.__version__ == jaxlib.__version__ == '$(JAX_FLOOR)' else 1)"; \
	then echo "floor: jax and jaxlib $(JAX_FLOOR), the floor, are the releases make test ran on: skipped"; \
	else $(MAKE) floor-venv; fi

floor-venv: $(FLOOR_VENV)/.installed-$(JAX_FLOOR)
	$(FLOOR_VENV)/bin/python -c "import jax; assert jax.__version__ == '$(JAX_FLOOR)', jax.__version__"
	$(FLOOR_VENV)/bin/python -m pytest -q -n 2 --dist worksteal -m "not slow" -p no:cacheprovider tests

ci: lint typecheck test docs floor test-next-jax

bench: $(VENV)/.installed-test
	$(BIN)/memwise bench

# The optimal-transport peers' benchmark in its own environment (POT, GeomLoss, torch,
# pykeops, OTT-JAX; several GB): `make bench` skips it when this is missing.
PEERS_VENV := benchmarks/.venv-peers

$(PEERS_VENV)/.installed: $(VENV)/.installed-test
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install --quiet "jax==$$($(BIN)/python -c 'import jax; print(jax.__version__)')" \
		ott-jax pot geomloss torch pykeops tqdm
	$(PEERS_VENV)/bin/pip install --quiet --no-deps -e .
	touch $@

bench-peers: $(PEERS_VENV)/.installed
	$(BIN)/python -m benchmarks ot_peers

clean:
	rm -rf $(VENV) $(FLOOR_VENV) build site src/*.egg-info
