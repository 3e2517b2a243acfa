"""One comparison for the dtype tests: the largest error relative to the reference's
largest entry, against a float64 reference computed on the same rounded inputs."""

import numpy as np


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
