"""Suite-wide set-up: the Hypothesis profile (see tests/_hypothesis.py), the sampled
conformance grids (see tests/_grid.py) and a persistent compilation cache shared by the
suite's worker processes and the subprocesses they start.

The suite compiles the same programs many times: a primitive run eagerly (every
``lax.while_loop`` of an un-jitted gradient) is compiled again for each trace, and the
dense references repeat across transformations. XLA's persistent cache
(``jax_compilation_cache_dir``) returns the executable for an HLO module it has seen; on
2 cores it made the dtype-and-transformation matrix's optimal-transport cases 2-4x faster.
A cached executable reports the same ``memory_analysis()``. ``MEMWISE_TEST_JAX_CACHE=0``
turns it off.
"""

import gc
import os
import pathlib

import _close
import _grid
import _hypothesis  # noqa: F401  (registers and loads the profile)
import jax
import pytest

if os.environ.get("MEMWISE_TEST_JAX_CACHE", "1") != "0":
    _CACHE = {  # option: (value, type)
        "jax_compilation_cache_dir": (
            pathlib.Path(__file__).parents[1] / "build" / "jax-cache",
            str,
        ),
        "jax_persistent_cache_min_compile_time_secs": (0, float),
        "jax_persistent_cache_min_entry_size_bytes": (-1, int),
    }
    for _option, (_value, _type) in _CACHE.items():
        os.environ.setdefault(_option.upper(), str(_value))  # for subprocesses too

    for _option, (_value, _type) in _CACHE.items():
        if hasattr(jax.config, _option):  # the floor release may lack one
            jax.config.update(_option, _type(os.environ[_option.upper()]))

# Reference generators run in their own environment (jax 0.4.30 + neural-tangents); under
# `--doctest-modules` importing one turned on float64 for every later test in the worker.
collect_ignore = ["data"]


@pytest.fixture(scope="module")
def float64_module():
    """float64 for one module's tests (``pytestmark = pytest.mark.usefixtures(
    "float64_module")``): a global jax_enable_x64 would change every other module's dtypes
    (and the OTT comparisons' iteration counts) once pytest collects the file."""
    import jax

    with jax.enable_x64(True):
        yield


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "grid(fraction=0.25): a conformance grid; make test runs a stratified sample of its"
        " cases, MEMWISE_TEST_GRID=full every case (tests/_grid.py)",
    )
    config.addinivalue_line(
        "markers",
        "default_precision: runs at the backend's default matmul precision, not HIGHEST"
        " (tests/_close.py)",
    )
    if _grid.mode() == "sample":
        _grid.seed()  # drawn here, in the controller, before xdist starts its workers


def pytest_report_header(config):
    if _grid.mode() == "full":
        return "grids: full (MEMWISE_TEST_GRID=full)"
    return (
        f"grids and slow tests: sampled, seed {_grid.seed()} ({_grid.SLOW_FRACTION:.0%} of each file's slow"
        " tests on average, at least one where the file has no other test;"
        f" MEMWISE_TEST_SEED={_grid.seed()} repeats this sample; MEMWISE_TEST_GRID=full runs"
        " every case)"
    )


def pytest_collection_modifyitems(config, items):
    if _grid.mode() == "full":
        return
    groups: dict = {}
    for item in items:
        marker = item.get_closest_marker("grid")
        callspec = getattr(item, "callspec", None)
        if marker is not None and callspec is not None:
            key = f"{item.module.__name__}::{item.originalname}"
            groups.setdefault(key, (marker, []))[1].append(item)
    dropped = []
    for key, (marker, group) in groups.items():
        fraction = marker.kwargs.get("fraction", _grid.DEFAULT_FRACTION)
        cases = [_grid.strata(i.callspec.params, i.callspec.indices) for i in group]
        keep = set(_grid.sample(cases, fraction, key))
        dropped += [item for i, item in enumerate(group) if i not in keep]
    # The slow tier outside the grids' cases: a seeded share of each file's (tests/_grid.py).
    sampled = {id(item) for _, group in groups.values() for item in group}
    slow: dict = {}
    for item in items:
        if item.get_closest_marker("slow") and id(item) not in sampled:
            slow.setdefault(item.nodeid.split("::")[0], []).append(item)
    files: dict = {}
    for item in items:
        path = item.nodeid.split("::")[0]
        files[path] = files.get(path, 0) + 1
    for path, group in slow.items():
        # a file whose every test is in this tier runs at least one of them
        alone = files[path] == len(group)
        keep = set(_grid.sample_slow([i.nodeid for i in group], path, at_least_one=alone))
        dropped += [item for i, item in enumerate(group) if i not in keep]
    if dropped:
        drop = set(map(id, dropped))
        items[:] = [item for item in items if id(item) not in drop]
        config.hook.pytest_deselected(items=dropped)


if not _close.ON_CPU:
    # float32 products at float32 precision on every backend (tests/_close.py): a TPU's
    # default is bfloat16 passes. A test of the default precision is marked
    # ``default_precision``.
    jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(autouse=True)
def _default_precision(request):
    if _close.ON_CPU or not request.node.get_closest_marker("default_precision"):
        yield
    else:
        with jax.default_matmul_precision("default"):
            yield


def pytest_sessionfinish(session):
    """JAX frees device buffers from a garbage-collection callback (jax/_src/lib). xdist
    ends a worker by interrupting its main thread, which can land inside that callback:
    the run passed, and then printed a ``KeyboardInterrupt`` traceback from
    ``_xla_gc_callback``. Once the session is over nothing needs the callback: collect,
    then remove it."""
    gc.collect()
    gc.callbacks[:] = [c for c in gc.callbacks if getattr(c, "__name__", "") != "_xla_gc_callback"]
