"""The tests' comparisons: one for the dtype tests (the largest error relative to the
reference's largest entry, against a float64 reference computed on the same rounded
inputs) with its one tolerance table, and one for pytrees."""

import jax
import numpy as np

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
    assert error <= tolerance * scale, f"{what}: error {error:.3g} at scale {scale:.3g}"


def assert_dtype_close(computation: str, got, expected, dtype: str) -> None:
    """:func:`assert_close` at ``TOLERANCE[computation][dtype]``."""
    assert_close(got, expected, TOLERANCE[computation][dtype], dtype)


def assert_tree_close(a, b, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Same tree structure, every leaf equal to ``rtol``/``atol``."""
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)
