"""The tests' comparisons, for every backend JAX runs on.

One module, as JAX's own test utilities have one: a comparison for the dtype tests (the
largest error relative to the reference's largest entry, against a float64 reference
computed on the same rounded inputs) with its one tolerance table, one for arrays and
pytrees (``assert_allclose``, ``assert_tree_close``), and memory assertions that say
which backend a figure is about.

Backends. Tolerances are written for XLA:CPU. On a TPU float32 matrix products run at
bfloat16 precision by default (about 1e-3 relative): a test that means to check float32
arithmetic runs at ``precision=HIGHEST`` there (conftest.py sets it for the session on
every backend but CPU; a test of the default precision is marked
``default_precision``), and what HIGHEST leaves (transcendentals, and sums the backend
orders differently) is the backend's floor in :data:`FLOOR`: a tolerance is the larger
of the test's and the floor, so no tolerance grows on CPU, whose floor is zero.

Memory. ``memory_analysis()`` reports XLA's buffer assignment, which differs by backend
(a TPU pads the two minor dimensions to its (8, 128) tiles). :func:`assert_bytes_equal`
is exact on CPU and elsewhere holds the bound the library promises instead.
"""

import os

import jax
import numpy as np

BACKEND = jax.default_backend()
ON_CPU = BACKEND == "cpu"

# The smallest relative and absolute tolerance of a float32 (or wider) comparison on a
# backend, at precision=HIGHEST; narrower dtypes keep their own tables.
FLOOR = {"cpu": (0.0, 0.0), "tpu": (1e-3, 1e-4), "gpu": (1e-5, 1e-6)}


def floor(rtol: float = 0.0, atol: float = 0.0) -> tuple[float, float]:
    """``(rtol, atol)`` at least this backend's floor (unchanged on CPU)."""
    low_r, low_a = FLOOR.get(BACKEND, FLOOR["tpu"])
    return max(rtol, low_r), max(atol, low_a)


def assert_allclose(actual, desired, rtol: float = 1e-7, atol: float = 0.0, **kwargs) -> None:
    """``np.testing.assert_allclose`` at the backend's floor. With
    ``MEMWISE_TEST_TOLERANCE_LOG`` set, each comparison appends to that file how much of
    its tolerance it used (the largest ``|a - d| / (atol + rtol |d|)``): how a backend's
    floor is measured."""
    rtol, atol = floor(rtol, atol)
    log = os.environ.get("MEMWISE_TEST_TOLERANCE_LOG")
    if log:
        a, d = np.asarray(actual, np.float64), np.asarray(desired, np.float64)
        used = np.abs(a - d) / (atol + rtol * np.abs(d) + 1e-300)
        with open(log, "a") as f:
            test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
            f.write(
                f"{float(np.nanmax(used, initial=0.0)):.3g} rtol={rtol:g} atol={atol:g} {test}\n"
            )
    np.testing.assert_allclose(actual, desired, rtol=rtol, atol=atol, **kwargs)


def assert_bytes_equal(
    got: int, expected: int, what: str = "", *, within: int = 0, slack: float = 0.25
) -> None:
    """Equal compiled bytes on CPU (to ``within`` bytes, where a test names why); elsewhere
    at most ``1 + slack`` times (layouts pad a backend's buffers differently, so only the
    bound is the library's promise)."""
    if ON_CPU:
        assert abs(got - expected) <= within, (what, got, expected)
    else:
        assert got <= expected * (1 + slack), (what, BACKEND, got, expected)


# Largest error relative to the float64 reference's largest entry, by the computation
# checked (their rounding differs: a sum of products, a jvp, a kernel's recursion
# through layers) and the dtype of its inputs.
TOLERANCE = {
    "accumulate": {"float64": 1e-12, "float32": 1e-5, "float16": 1.5e-3, "bfloat16": 1e-2},
    "linearize": {"float64": 1e-12, "float32": 1e-5, "float16": 4e-3, "bfloat16": 3e-2},
    "ntk_empirical": {"float64": 1e-10, "float32": 1e-5, "float16": 4e-3, "bfloat16": 3e-2},
    "ntk_kernels": {"float64": 1e-10, "float32": 1e-5, "float16": 5e-3, "bfloat16": 5e-2},
    "ntk_predict": {"float32": 1e-4, "bfloat16": 5e-2},
    "matrix": {"float32": 1e-4, "float64": 1e-9, "bfloat16": 6e-2, "float16": 1e-2},
}


def assert_close(
    got, expected, tolerance: float, what: str = "", *, scale_floor: float = 0.0
) -> None:
    """``scale_floor``: the scale is at least this (an absolute tolerance for small results)."""
    got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
    assert got.shape == expected.shape, (what, got.shape, expected.shape)
    assert np.all(np.isfinite(got)), (what, got)
    scale = max(float(np.max(np.abs(expected), initial=0.0)), scale_floor)
    error = float(np.max(np.abs(got - expected), initial=0.0))
    tolerance = floor(tolerance)[0]
    assert error <= tolerance * scale, f"{what}: error {error:.3g} at scale {scale:.3g}"


def assert_dtype_close(computation: str, got, expected, dtype: str) -> None:
    """:func:`assert_close` at ``TOLERANCE[computation][dtype]``."""
    assert_close(got, expected, TOLERANCE[computation][dtype], dtype)


def assert_tree_close(a, b, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Same tree structure, every leaf equal to ``rtol``/``atol``."""
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)
