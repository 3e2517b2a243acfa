"""The gradient-flow solve shared by the closed-form predictions of ``memwise.ntk`` and
``memwise.nt``.

An infinitely wide network trained on the mean squared error by gradient flow applies
``M_t = Theta^-1 (I - exp(-Theta t / N))`` to its targets (Lee et al. 2019; see
:mod:`memwise.ntk.predict` for the formulas). :class:`Propagator` applies ``M_t`` (a
Cholesky solve at infinite time, one eigendecomposition for any number of finite times)
and :func:`check_time` checks ``t``. Kept in a private module below both
:mod:`memwise.ntk.predict` and :mod:`memwise.nt.predict`, which each use it, so that
neither imports private names of the other.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np

__all__ = ["Propagator", "check_time"]


def check_time(t: Any) -> None:
    """``t``: None (infinite time), a time >= 0 or an array of them (a traced ``t`` is
    not checked)."""
    if t is None or isinstance(t, jax.core.Tracer):
        return
    value = np.asarray(t)
    if not (np.issubdtype(value.dtype, np.integer) or np.issubdtype(value.dtype, np.floating)):
        raise TypeError(
            f"t must be None (infinite time), a training time >= 0 or an array of them, got {t!r}"
        )
    if not np.all(value >= 0):
        raise ValueError(f"t must be >= 0 (a training time) or None for infinite time, got {t!r}")


class Propagator:
    """``M_t B`` for the regularised train-train kernel ``Theta`` (see :mod:`memwise.ntk.predict`):
    ``b.shape``, or ``t.shape + b.shape`` for an array of times (one eigendecomposition
    for all of them)."""

    def __init__(self, theta: jax.Array, ridge: Any, t: Any, n_outputs: int):
        n = theta.shape[0]
        theta = 0.5 * (theta + theta.T)  # exact symmetry, whatever the tile order
        theta = theta + (ridge * jnp.trace(theta) / n) * jnp.eye(n, dtype=theta.dtype)
        self.t = t
        self.normalization = n * n_outputs  # neural-tangents' y_train.size
        if t is None:
            self.factor = jsl.cho_factor(theta, lower=True)
        else:
            self.evals, self.evecs = jnp.linalg.eigh(theta)

    def __call__(self, b: jax.Array, time_scale: float = 1.0) -> jax.Array:
        if self.t is None:
            return jsl.cho_solve(self.factor, b)
        evals = jnp.maximum(self.evals, 0.0)
        t = jnp.asarray(self.t, self.evals.dtype) * time_scale
        gain = -jnp.expm1(-evals * t[..., None] / self.normalization) / jnp.abs(self.evals)
        return self.evecs @ (gain[..., None] * (self.evecs.T @ b))
