"""Suite-wide set-up: the Hypothesis profile (see tests/_hypothesis.py) and a persistent
compilation cache shared by the suite's worker processes and the subprocesses they start.

The suite compiles the same programs many times: a primitive run eagerly (every
``lax.while_loop`` of an un-jitted gradient) is compiled again for each trace, and the
dense references repeat across transformations. XLA's persistent cache
(``jax_compilation_cache_dir``) returns the executable for an HLO module it has seen; on
2 cores it made the dtype-and-transformation matrix's optimal-transport cases 2-4x faster.
A cached executable reports the same ``memory_analysis()``. ``MEMWISE_TEST_JAX_CACHE=0``
turns it off.
"""

import os
import pathlib

import _hypothesis  # noqa: F401  (registers and loads the profile)
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
    import jax

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
