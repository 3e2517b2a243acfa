"""Closed-form predictions of infinitely wide networks trained by gradient descent.

An infinitely wide network trained on the mean squared error by gradient flow evolves
as its linearization (Lee et al. 2019, "Wide neural networks of any depth evolve as
linear models under gradient descent"). Over random initializations its outputs on test
inputs are Gaussian, with closed-form mean and covariance at every training time ``t``
(Lee et al. 2019, eqs. (15)-(16); for the NNGP, Bayesian inference with the NNGP kernel,
Lee et al. 2018). With ``Theta`` the train-train kernel (the NTK, or the NNGP for
``get="nngp"``) plus ``ridge * mean(diag Theta)`` on its diagonal, ``K`` the NNGP,
``N = y_train.size`` and ``M_t = Theta^-1 (I - exp(-Theta t / N))``:

    mean(t) = Theta(x, X) M_t y
    cov(t)  = K(x, x) + Theta(x, X) M_t K(X, X) M_t Theta(X, x)
              - (Theta(x, X) M_t K(X, x) + transpose)          (NTK)
    cov(t)  = K(x, x) - K(x, X) M_2t K(X, x)                   (NNGP)

``t=None`` is infinite time, ``M = Theta^-1`` (a Cholesky solve); a finite ``t`` uses the
eigendecomposition of ``Theta`` (negative rounding-level eigenvalues clipped to zero).
This is neural-tangents' ``predict.gradient_descent_mse_ensemble`` (Novak et al. 2020)
with its defaults (learning rate 1, ``diag_reg`` relative to the mean diagonal, one
kernel shared by all outputs), with every kernel matrix computed in tiles by
:mod:`memwise.ntk.regression`'s machinery: the test-by-train kernel of the mean is
summed over chunks of the training set and never held.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from memwise._dtypes import accumulation_dtype
from memwise.chunked import over_row_chunks
from memwise.ntk._gradient_flow import Propagator, check_time
from memwise.ntk.regression import (
    _check_pair,
    _check_ridge,
    _check_same_inputs,
    _matrix,
    _PairKernel,
    _predict_block,
)
from memwise.tiling import ChunkSize

__all__ = ["predict"]


def predict(
    kernel_fn: Callable,
    x_train: jax.Array,
    y_train: jax.Array,
    x_test: jax.Array,
    *,
    ridge: float,
    t: Any = None,
    get: str = "ntk",
    compute_cov: bool = False,
    chunk_size: ChunkSize = "auto",
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Mean (and covariance) of an infinitely wide network trained on MSE for time ``t``.

    The outputs on ``x_test`` of an infinite ensemble of infinitely wide networks trained
    by gradient flow on ``(x_train, y_train)`` (Lee et al. 2019), as neural-tangents'
    ``nt.predict.gradient_descent_mse_ensemble(kernel_fn, x_train, y_train,
    diag_reg=ridge)(t, x_test, get, compute_cov)``.

    Args:
      kernel_fn: a :func:`memwise.ntk.kernels.serial` kernel, or any
        ``kernel_fn(x1, x2, get=...) -> (n1, n2)`` that accepts ``get="nngp"`` and
        ``"ntk"``.
      x_train: (n, ...) training inputs; ``y_train`` (n,) or (n, outputs).
      x_test: (m, ...) test inputs, same shape per input as ``x_train``.
      ridge: >= 0, added to the train-train kernel's diagonal times its mean diagonal
        (neural-tangents' ``diag_reg``).
      t: training time (gradient flow with learning rate 1), a scalar >= 0, or an
        array of them (every kernel and the eigendecomposition computed once for all
        times); ``None`` (default) is infinite time.
      get: ``"ntk"`` (gradient descent on every layer) or ``"nngp"`` (only the readout
        trained: Bayesian inference with the NNGP as ``t`` -> infinity).
      compute_cov: also return the (m, m) covariance of the test outputs (the same for
        every output dimension).
      chunk_size: ``(rows, cols)`` tile of the kernel matrices: test inputs x training
        inputs (an int for both, or ``"auto"``).

    Returns:
      The (m, outputs) mean ((m,) when ``y_train`` is a vector), or ``(mean, cov)``
      with ``compute_cov=True``, in the dtype of ``K @ y_train``; for an array ``t``,
      with ``t.shape`` in front of each.

    Raises:
      ValueError / TypeError: a bad ``ridge``, ``t``, ``get`` or shapes, naming the
        argument.

    Memory/compute: the (n, n) training kernel(s), its Cholesky factor or (finite ``t``)
    eigendecomposition, and one tile of per-pair intermediates; the mean never holds the
    (m, n) test-by-train kernel. ``compute_cov`` holds the (m, n) test-by-train kernels
    (both NTK and NNGP for ``get="ntk"``) and the (m, m) covariance. The solve and the
    sums run in at least float32. Each kernel tile is computed once per kernel needed
    (twice for ``get="ntk"`` with ``compute_cov``: NTK and NNGP), whatever the number
    of times; an array ``t`` adds per time the (n, outputs) coefficients and, with
    ``compute_cov``, the (n, m) propagated kernels and the (m, m) covariance.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> from memwise import ntk
        >>> k = ntk.kernels
        >>> kernel_fn = k.serial(k.Dense(W_std=1.3, b_std=0.1), k.Gelu(), k.Dense())
        >>> x = jax.random.normal(jax.random.PRNGKey(0), (12, 4))
        >>> y = jnp.sin(x[:, :2])
        >>> predict = jax.jit(lambda x, y, x_test: ntk.predict(
        ...     kernel_fn, x, y, x_test, ridge=1e-3, t=10.0, compute_cov=True,
        ...     chunk_size=4))
        >>> mean, cov = predict(x, y, x[:5] + 0.1)
        >>> mean.shape, cov.shape
        ((5, 2), (5, 5))
    """
    _check_ridge(ridge)
    check_time(t)
    if get not in ("ntk", "nngp"):
        raise ValueError(f"get must be 'ntk' or 'nngp', got {get!r}")
    if not isinstance(compute_cov, bool):
        raise TypeError(f"compute_cov must be True or False, got {compute_cov!r}")
    x_train, y_train, vector = _check_pair(x_train, y_train, "x_train", "y_train")
    x_test = jnp.asarray(x_test)
    if x_test.ndim < 2 or x_test.shape[0] == 0:
        raise ValueError(
            f"x_test must be (m, ...) with at least one input, got shape {x_test.shape}"
        )
    _check_same_inputs(x_train, x_test, "x_train", "x_test")

    kernel = _PairKernel(kernel_fn, get)
    nngp = kernel if get == "nngp" else _PairKernel(kernel_fn, "nngp")
    tiles = kernel.tiles(x_test, x_train, chunk_size)
    rows, cols = tiles.rows, tiles.cols
    p_train = kernel.prepare(x_train, cols)

    theta = _matrix(kernel, p_train, p_train, cols, cols)
    out_dtype = jnp.result_type(theta.dtype, y_train.dtype)
    wide = accumulation_dtype(theta.dtype)  # no bfloat16/float16 Cholesky or eigh in JAX
    propagate = Propagator(theta.astype(wide), ridge, t, y_train.shape[1])
    alpha = propagate(y_train.astype(wide))  # times + (n, outputs)
    # Every time's coefficients side by side: one tiled pass for all of them.
    (n, outputs), times = y_train.shape, (() if t is None else jnp.shape(t))
    count = int(np.prod(times, dtype=np.int64))
    alpha = jnp.moveaxis(alpha.reshape(count, n, outputs), 0, 1).reshape(n, count * outputs)
    mean = over_row_chunks(
        lambda block: _predict_block(kernel, block, p_train, alpha, cols), x_test, rows
    ).astype(out_dtype)
    mean = jnp.moveaxis(mean.reshape(mean.shape[0], count, outputs), 1, 0)
    mean = mean.reshape(times + mean.shape[1:])
    mean = mean[..., 0] if vector else mean
    if not compute_cov:
        return mean

    p_test = kernel.prepare(x_test, rows)
    k_test = _matrix(nngp, p_test, p_test, rows, rows).astype(wide)
    k_test = 0.5 * (k_test + k_test.T)
    theta_cross = _matrix(kernel, p_test, p_train, rows, cols).astype(wide)  # (m, n)
    if get == "nngp":
        cov = k_test - theta_cross @ propagate(theta_cross.T, time_scale=2.0)
    else:
        k_cross = _matrix(nngp, p_test, p_train, rows, cols).astype(wide)
        k_train = _matrix(nngp, p_train, p_train, cols, cols).astype(wide)
        k_train = 0.5 * (k_train + k_train.T)
        gain = propagate(theta_cross.T)  # (n, m)
        mixed = theta_cross @ propagate(k_cross.T)
        cov = k_test + gain.mT @ k_train @ gain - (mixed + mixed.mT)
    return mean, cov.astype(out_dtype)
