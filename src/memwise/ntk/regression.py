"""Kernel ridge regression and the KIP loss, tile by tile so their gradients fit.

Kernel regression with a (neural tangent) kernel predicts ``K(x, X) (K(X, X) + r I)^-1 Y``.
KIP, "kernel inducing points" (Nguyen, Chen, Lee, ICLR 2021, "Dataset meta-learning
from kernel ridge-regression"), learns a small support set ``(X_s, Y_s)`` by descending
the regression loss it gives on a large target set. With a conv NTK every kernel entry
carries one covariance per pixel, so the naive gradient keeps the per-pixel tiles of
every (target, support) pair: about 3 MiB per target image for 100 MNIST-sized support
images in neural-tangents (1,500 MiB at 500 targets; 176 GiB at 60,000, the size of the
neural-tangents question "Question regarding OOM issues").

Here every kernel matrix is computed in (rows, cols) tiles through
:mod:`memwise.chunked`: the target set is a :func:`~memwise.chunked_sum` over
row chunks whose prediction ``sum_j k(x, x_j) alpha_j`` is itself a ``chunked_sum`` over
column chunks of the support set. Both sums recompute their tiles in the backward pass,
so the gradient w.r.t. the support images and labels holds one (rows x cols x pixels)
tile's intermediates whatever the number of targets: 282 MiB for 500 x 10 tiles of the
KIP report's conv kernel, at 500 or 60,000 targets; 102 MiB for a Myrtle-style kernel
(pooling: a pair's pixel-by-pixel covariance, so one-pair tiles) at 6,000 or 60,000. Chunking the targets alone still holds
a target chunk against the *whole* support set (4.1 GiB at 500 x 100 x 784 floats).
The linear solve is a Cholesky factorisation (cheaper and more stable to differentiate
than a general solve), on the small support/train kernel.

Regularisation is scale-free as in KIP: ``ridge * mean(diag K)`` is added to the
diagonal, so ``ridge`` means the same for an NTK and an NNGP of any depth.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from memwise._dtypes import accumulation_dtype
from memwise.chunked import chunked_map, chunked_sum, over_row_chunks, sum_over_chunks
from memwise.ntk.kernels import KernelFn
from memwise.sharding import check_divisible, devices, row_sharding, sharded_call
from memwise.tiling import Chunking, ChunkSize, Tiling, pair_bytes, tiling

__all__ = ["kernel_regression", "kip_loss"]


class _PairKernel:
    """A kernel as a function of one pair of (prepared) inputs, for the chunked sums.

    A :class:`~memwise.ntk.kernels.KernelFn` is evaluated in two steps so that each
    input's own variances are computed once per chunk, not once per pair; any other
    ``kernel_fn(x1, x2) -> (n1, n2)`` is evaluated on single inputs.
    """

    def __init__(self, kernel_fn: Callable, get: str | None):
        if not callable(kernel_fn):
            raise TypeError(f"kernel_fn must be callable kernel_fn(x1, x2), got {kernel_fn!r}")
        self.kernel_fn = kernel_fn
        # The kernel when it is a KernelFn (evaluated in two steps), else None.
        self.structured = kernel_fn if isinstance(kernel_fn, KernelFn) else None
        self.kwargs = {} if get is None else {"get": get}
        if self.structured is not None and get is None:
            self.kwargs = {"get": "ntk"}

    def prepare(self, x: jax.Array, chunk: int | Chunking) -> Any:
        structured = self.structured
        if structured is None:
            return x

        def one(xi):
            p = structured.prepare(xi[None])
            return jax.tree_util.tree_map(lambda a: a[0], p)

        return chunked_map(one, x, chunk_size=chunk)

    def pair(self, p1: Any, p2: Any) -> jax.Array:
        batch = lambda p: jax.tree_util.tree_map(lambda a: a[None], p)  # noqa: E731
        if self.structured is not None:
            # A serial kernel is symmetric; the second input (the training or support
            # side, which KIP differentiates) goes first, so that the gradient of its
            # per-pixel variances sums along rows of a pixel-by-pixel tile, not down
            # columns (a third of a Myrtle kernel's KIP gradient at 32x32 pixels).
            k = self.structured.cross(batch(p2), batch(p1), **self.kwargs)
            assert not isinstance(k, tuple)  # one kernel asked for: get is a str
            return k[0, 0]
        return jnp.reshape(self.kernel_fn(batch(p1), batch(p2), **self.kwargs), ())

    def prepare_block(self, x: jax.Array, chunk_size: int | None = None) -> Any:
        """``x`` prepared as one block, or ``chunk_size`` inputs at a time for kernels
        that pool: their variances come from each input's own pixel-by-pixel covariance,
        (H*W)^2 numbers per input (1.2 GiB for a block of 500 28x28 images)."""
        if self.structured is None:
            return x
        if self.structured.pools and chunk_size is not None and x.shape[0] > chunk_size:
            return self.prepare(x, chunk_size)
        return self.structured.prepare(x)

    def first(self, x: jax.Array) -> Any:
        """The first input of ``x``, prepared: an argument of :meth:`pair`."""
        return jax.tree_util.tree_map(lambda a: a[0], self.prepare_block(x[:1]))

    def dtype(self, x: jax.Array) -> Any:
        """The kernel's dtype on inputs like ``x`` (evaluated abstractly)."""
        return jax.eval_shape(lambda x: self.pair(self.first(x), self.first(x)), x).dtype

    def tiles(self, x_rows: jax.Array, x_cols: jax.Array, chunk_size: ChunkSize) -> Tiling:
        """The tiling of rows x columns; for ``"auto"`` sized by one pair's intermediates."""

        def nbytes():
            return pair_bytes(self.pair, self.first(x_rows), self.first(x_cols))

        return tiling(x_rows.shape[0], x_cols.shape[0], chunk_size, pair_bytes=nbytes)


def _matrix(kernel: _PairKernel, p1: Any, p2: Any, rows: Chunking, cols: Chunking) -> jax.Array:
    """The (n1, n2) kernel, computed and differentiated one (rows, cols) tile at a time."""

    def block(p_rows):
        column = lambda pj: jax.vmap(lambda pi: kernel.pair(pi, pj))(p_rows)  # noqa: E731
        return chunked_map(column, p2, chunk_size=cols).T

    return over_row_chunks(block, p1, rows)


def _predict_block(
    kernel: _PairKernel, x_rows: jax.Array, p_train: Any, alpha: jax.Array, cols: Chunking
) -> jax.Array:
    """sum_j k(x, x_j) alpha_j for a block of inputs (R, O), summed over train chunks.

    In ``alpha``'s dtype (at least float32, see :func:`_solve`) whatever the kernel's.
    """
    p_rows = kernel.prepare_block(x_rows, cols.size)

    def column(item):
        pj, aj = item
        k = jax.vmap(lambda pi: kernel.pair(pi, pj))(p_rows)
        return k.astype(aj.dtype)[:, None] * aj[None, :]

    return chunked_sum(column, (p_train, alpha), chunk_size=cols)


def _check_ridge(ridge: Any) -> None:
    if isinstance(ridge, jax.core.Tracer):
        return
    value = np.asarray(ridge)
    if value.shape != () or not np.issubdtype(value.dtype, np.number):
        raise TypeError(f"ridge must be a non-negative float, got {ridge!r}")
    if not value >= 0:
        raise ValueError(
            f"ridge must be >= 0 (it is added to the kernel's diagonal, scaled by its mean), "
            f"got {ridge!r}; use e.g. ridge=1e-6"
        )


def _check_pair(x: Any, y: Any, x_name: str, y_name: str) -> tuple[jax.Array, jax.Array, bool]:
    x = jnp.asarray(x)
    y = jnp.asarray(y)
    if x.ndim < 2:
        raise ValueError(f"{x_name} must be (n, features) or (n, *pixels, channels), got {x.shape}")
    if x.shape[0] == 0:
        raise ValueError(
            f"{x_name} has no inputs (shape {x.shape}); pass at least one "
            f"(a regression on an empty set has no solution, a mean over it no value)"
        )
    vector = y.ndim == 1
    if vector:
        y = y[:, None]
    if y.ndim != 2:
        raise ValueError(f"{y_name} must be (n,) or (n, outputs), got shape {y.shape}")
    if y.shape[0] != x.shape[0]:
        raise ValueError(
            f"{x_name} has {x.shape[0]} inputs but {y_name} has {y.shape[0]} rows; they must match"
        )
    if not jnp.issubdtype(x.dtype, jnp.floating) or not jnp.issubdtype(y.dtype, jnp.floating):
        raise TypeError(f"{x_name} and {y_name} must be float arrays, got {x.dtype}, {y.dtype}")
    return x, y, vector


def _check_same_inputs(a: jax.Array, b: jax.Array, a_name: str, b_name: str) -> None:
    if a.shape[1:] != b.shape[1:]:
        raise ValueError(
            f"{a_name} and {b_name} must have the same shape per input (image shape), got "
            f"{a.shape[1:]} and {b.shape[1:]}"
        )


def _solve(
    kernel: _PairKernel, p_train: Any, y_train: jax.Array, ridge: Any, cols: Chunking
) -> tuple[jax.Array, Any]:
    """alpha = (K + ridge mean(diag K) I)^-1 y via Cholesky, in at least float32.

    Returns alpha and the dtype of the dense result ``K @ alpha`` (the kernel's and
    ``y``'s), which the callers cast their float32 sums back to.
    """
    k = _matrix(kernel, p_train, p_train, cols, cols)
    out_dtype = jnp.result_type(k.dtype, y_train.dtype)
    # JAX's Cholesky has no bfloat16/float16 kernel, and a low-precision solve (or sum
    # over the training set, see _predict_block) would lose what the kernel keeps.
    k = k.astype(accumulation_dtype(k.dtype))
    n = k.shape[0]
    k = 0.5 * (k + k.T)  # exact symmetry for the factorisation, whatever the tile order
    scale = jnp.trace(k) / n
    k_reg = k + (ridge * scale) * jnp.eye(n, dtype=k.dtype)
    factor = jsl.cho_factor(k_reg, lower=True)
    return jsl.cho_solve(factor, y_train.astype(k.dtype)), out_dtype


def kernel_regression(
    kernel_fn: Callable,
    x_train: jax.Array,
    y_train: jax.Array,
    x_test: jax.Array,
    *,
    ridge: float,
    chunk_size: ChunkSize = "auto",
    get: str | None = None,
) -> jax.Array:
    """Kernel ridge regression: ``K(x_test, X) (K(X, X) + ridge mean(diag K) I)^-1 Y``.

    Args:
      kernel_fn: a :func:`memwise.ntk.kernels.serial` kernel, or any
        ``kernel_fn(x1, x2) -> (n1, n2)`` (e.g. a wrapped :func:`memwise.ntk.empirical`).
      x_train: (n, ...) training inputs; ``y_train`` (n,) or (n, outputs).
      x_test: (m, ...) inputs to predict, same shape per input as ``x_train``.
      ridge: >= 0, scale-free regulariser (times the mean of the kernel's diagonal).
      chunk_size: ``(rows, cols)`` tile: rows of test inputs, cols of training inputs
        (an int for both, or ``"auto"``).
      get: which kernel of a ``serial`` network (``"ntk"``, default, or ``"nngp"``);
        passed on to other kernel functions when given.

    Returns:
      (m, outputs) predictions ((m,) when ``y_train`` is a vector), in the dtype of
      ``K @ y_train``; an empty ``x_test`` gives empty predictions.

    Raises:
      ValueError: ``x_train`` is empty (nothing to regress on).

    Precision: the solve and the sums over the training set run in at least float32
    (bfloat16/float16 kernels are cast up; JAX's Cholesky has no kernel for them), and
    the predictions are cast back.

    Memory: the (n, n) training kernel and one tile of per-pair intermediates; the test
    kernel is never held (predictions are summed over chunks of the training set), also
    under ``jax.grad``. Compute: the backward recomputes every tile once.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> from memwise import ntk
        >>> k = ntk.kernels.serial(
        ...     ntk.kernels.Dense(), ntk.kernels.Relu(), ntk.kernels.Dense())
        >>> x = jnp.linspace(-1, 1, 12).reshape(6, 2)
        >>> y = jnp.sin(x[:, 0])
        >>> fit = jax.jit(lambda x, y, x_test: ntk.kernel_regression(
        ...     k, x, y, x_test, ridge=1e-6))
        >>> # a tiny ridge interpolates the training targets
        >>> prediction = fit(x, y, x[:2])
        >>> prediction.shape, bool(jnp.allclose(prediction, y[:2], atol=1e-3))
        ((2,), True)
    """
    _check_ridge(ridge)
    x_train, y_train, vector = _check_pair(x_train, y_train, "x_train", "y_train")
    x_test = jnp.asarray(x_test)
    if x_test.ndim < 2:
        raise ValueError(
            f"x_test must be (m, ...) with a leading axis of inputs, got {x_test.shape}"
        )
    _check_same_inputs(x_train, x_test, "x_train", "x_test")
    kernel = _PairKernel(kernel_fn, get)
    if x_test.shape[0] == 0:  # no tiles to run: the dense (0, outputs) result
        dtype = jnp.result_type(kernel.dtype(x_train), y_train.dtype)
        pred = jnp.zeros((0, y_train.shape[1]), dtype)
        return pred[:, 0] if vector else pred
    tiles = kernel.tiles(x_test, x_train, chunk_size)
    p_train = kernel.prepare(x_train, tiles.cols)
    alpha, out_dtype = _solve(kernel, p_train, y_train, ridge, tiles.cols)
    pred = over_row_chunks(
        lambda block: _predict_block(kernel, block, p_train, alpha, tiles.cols),
        x_test,
        tiles.rows,
    ).astype(out_dtype)
    return pred[:, 0] if vector else pred


def kip_loss(
    kernel_fn: Callable,
    x_support: jax.Array,
    y_support: jax.Array,
    x_target: jax.Array,
    y_target: jax.Array,
    *,
    ridge: float,
    chunk_size: ChunkSize = "auto",
    get: str | None = None,
) -> jax.Array:
    """The KIP loss: mean squared error of support-set kernel regression on the targets.

    ``0.5 * mean((K_ts (K_ss + ridge mean(diag K_ss) I)^-1 y_s - y_t)^2)`` over targets
    and outputs (Nguyen et al. 2021), differentiable in ``x_support`` and ``y_support``
    (and ``ridge``, the targets, and any array ``kernel_fn`` closes over).

    Args:
      kernel_fn: a :func:`memwise.ntk.kernels.serial` kernel or any
        ``kernel_fn(x1, x2) -> (n1, n2)``.
      x_support: the (n_s, ...) support inputs.
      y_support: their (n_s,) or (n_s, O) labels.
      x_target: the (n_t, ...) target inputs.
      y_target: their labels.
      ridge: >= 0, scale-free regulariser.
      chunk_size: ``(rows, cols)``: targets per chunk and support inputs per chunk; an
        int means square tiles (clipped to the support size), ``"auto"`` asks
        :func:`memwise.knobs.auto`.
      get: ``"ntk"`` (default) or ``"nngp"`` for a ``serial`` kernel.

    Returns:
      The scalar loss, in the dtype of the dense computation (the kernel's and the
      labels'); the solve and the sums run in at least float32, as in
      :func:`kernel_regression`.

    Raises:
      ValueError: ``x_support`` or ``x_target`` is empty.

    Memory: the gradient holds the support kernel (n_s, n_s) and one tile's per-pixel
    intermediates (rows x cols x pixels per layer), independent of ``n_t``: the target
    sum is a :func:`~memwise.chunked_sum` whose tiles are recomputed in the
    backward pass. Keep ``rows * cols`` moderate for conv kernels (e.g. (500, 10) for
    28x28 images). Compute: about 2-3 kernel evaluations per tile.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> from memwise import ntk
        >>> k = ntk.kernels.serial(
        ...     ntk.kernels.Dense(), ntk.kernels.Relu(), ntk.kernels.Dense())
        >>> # support
        >>> xs, ys = jax.random.normal(jax.random.PRNGKey(1), (4, 3)), jnp.eye(4)
        >>> xt = jax.random.normal(jax.random.PRNGKey(0), (10, 3))  # targets
        >>> yt = jnp.eye(4)[jnp.arange(10) % 4]
        >>> loss = lambda xs, ys: ntk.kip_loss(
        ...     k, xs, ys, xt, yt, ridge=1e-3, chunk_size=(5, 2))
        >>> value_and_grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        >>> value, (grad_x, grad_y) = value_and_grad(xs, ys)
        >>> round(float(value), 3), grad_x.shape, grad_y.shape
        (1.67, (4, 3), (4, 4))
    """
    _check_ridge(ridge)
    x_support, y_support, _ = _check_pair(x_support, y_support, "x_support", "y_support")
    x_target, y_target, _ = _check_pair(x_target, y_target, "x_target", "y_target")
    _check_same_inputs(x_support, x_target, "x_support", "x_target")
    if y_support.shape[1] != y_target.shape[1]:
        raise ValueError(
            f"y_support has {y_support.shape[1]} outputs per input but y_target has "
            f"{y_target.shape[1]}; they must match"
        )
    kernel = _PairKernel(kernel_fn, get)
    tiles = kernel.tiles(x_target, x_support, chunk_size)
    row_tiles, cols = tiles.rows, tiles.cols
    p_support = kernel.prepare(x_support, cols)
    alpha, out_dtype = _solve(kernel, p_support, y_support, ridge, cols)
    out_dtype = jnp.result_type(out_dtype, y_target.dtype)

    def squared_error(x_target, y_target, row_tiles):
        # Chunk indices, not the targets, are the loop's items (see over_row_chunks).

        def chunk_error(index):
            start = index * row_tiles.size
            xt = row_tiles.block(x_target, start)
            yt = row_tiles.block(y_target, start)
            valid = row_tiles.chunk_ids(index)[1]
            pred = _predict_block(kernel, xt, p_support, alpha, cols)
            error = jnp.sum((pred - yt.astype(pred.dtype)) ** 2, axis=1)
            return jnp.sum(jnp.where(valid, error, 0.0))

        return sum_over_chunks(chunk_error, row_tiles.n_chunks)

    split = row_sharding(x_target, None, None, "x_target")
    if split is None:
        total = squared_error(x_target, y_target, row_tiles)
    else:
        # The targets split over devices: each device sums its own, then one psum.
        mesh, axes = split
        check_divisible(x_target.shape[0], mesh, axes, "x_target")
        n_local = x_target.shape[0] // devices(mesh, axes)
        local_rows = Chunking(n_local, min(row_tiles.size, n_local))

        def local(xt, yt):
            return lax.psum(squared_error(xt, yt, local_rows), axes)

        total = sharded_call(local, mesh, (P(axes), P(axes)), P(), x_target, y_target)
    return (0.5 * total / y_target.size).astype(out_dtype)
