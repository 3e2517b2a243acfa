"""Pairwise log-sum-exps of inner products on a TPU: the vocabulary cross-entropy's fused
kernels (:mod:`memwise.engine.tpu_cross_entropy`) on the engine's ``"dot_scores"``
pattern, behind the backend seam (:mod:`memwise.engine.kernels`).

``log sum_j exp(x_i . y_j + w_j)`` is the cross-entropy's log-sum-exp with the points
``y`` as the ``(V, d)`` output layer and the column terms ``w`` as its bias, without a
label. A Sinkhorn pass of the squared Euclidean cost is one: ``-|x_i - y_j|^2 / eps =
(2 x_i / eps) . y_j - |y_j|^2 / eps - |x_i|^2 / eps``, the last term outside the
log-sum-exp; Gromov-Wasserstein's linearised cost is an inner product itself
(:func:`memwise.ot.passes.softmin`). Measured on a TPU v5e, 100 Sinkhorn iterations at
50,000 x 50,000 points in 64 dimensions take 1.1-1.2 s against the XLA tiles' 9.52 s
(``BENCHMARKS.md``); its blocks are :func:`pair_block_sizes`. Declined (the XLA loops
run instead): dtypes other than bfloat16 or float32, points of different dtypes, batch
dims, pair or constant operands, rings.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from memwise.engine import kernels
from memwise.engine.tpu_cross_entropy import (
    LANES,
    Blocks,
    Config,
    block_sizes,
    fit_block,
    statistics,
)

__all__ = ["DOT_KERNEL", "pair_block_sizes"]


def _operands(rows: Any, cols: Any) -> tuple[Any, Any, Any]:
    return rows, cols["y"], cols.get("w")


def _declines(
    call: kernels.KernelCall, rows: Any, cols: Any, pairs: Any, consts: Any
) -> str | None:
    why = kernels.points_on_one_device(call, pairs)
    if why is not None:
        return why
    if jax.tree.leaves(consts):
        return "constant operands"
    x, y, w = _operands(rows, cols)
    if x.ndim != 2 or y.ndim != 2 or (w is not None and w.ndim != 1):
        return "points other than (n, d) and (m, d) arrays with (m,) weights"
    if x.dtype != y.dtype or x.dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        return f"dtype {x.dtype} and {y.dtype} points (it takes bfloat16 or float32, both alike)"
    return None


def _apply(
    call: kernels.KernelCall, rows: Any, cols: Any, pairs: Any, consts: Any, *, interpret: bool
) -> Any:
    del pairs, consts
    x, y, w = _operands(rows, cols)
    (n, d), m = x.shape, y.shape[0]
    cfg = Config(
        "logsumexp",
        "vd",
        None,
        w is not None,
        n,
        m,
        pair_block_sizes(n, m, d, x.dtype.itemsize),
        interpret,
    )
    return statistics(cfg, x, y, w, None).astype(x.dtype)


def pair_block_sizes(n: int, m: int, d: int, itemsize: int = 4) -> Blocks:
    """Blocks for a log-sum-exp over ``n x m`` pairs of ``d`` features: about ``1024 x
    1024`` forward and backward where the features are few (each step is mostly the
    vector unit's exponentials), the cross-entropy's blocks (:func:`block_sizes`) where
    they are many. Measured on a TPU v5e (100 Sinkhorn iterations, 50,000 points, d =
    64, float32): 1,000 x 1,024 blocks 1.12 s, 2,000 x 2,048 1.20 s, 1,000 x 2,048 1.23 s,
    512 x 2,048 1.28 s, 1,000 x 4,096 1.35 s.

    Example::

        >>> pair_block_sizes(50_000, 50_000, 64)
        Blocks(tokens=1000, words=1024, tokens_bwd=1000, words_bwd=1024)
    """
    if d > 256:
        return block_sizes(n, m, d, itemsize)
    rows, cols = fit_block(n, 1024, 16 if itemsize == 2 else 8), fit_block(m, 1024, LANES)
    return Blocks(rows, cols, rows, cols)


DOT_KERNEL = kernels.register(
    kernels.Kernel(
        "fused log-sum-exp of inner products (Pallas, TPU)",
        "dot_scores",
        "logsumexp",
        ("tpu",),
        apply=_apply,
        declines=_declines,
    )
)
