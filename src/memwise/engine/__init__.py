"""The one 2-D tiled reduction engine, with a custom VJP whose backward is tiled too.

``tiled_reduce`` reduces the scores of every ``(row, column)`` pair over the columns,
one ``rows x cols`` tile at a time, and never holds more than a tile of scores in
either pass. The reductions are ``"sum"``, ``"logsumexp"``, ``"logsumexp_pick"`` (with
the score at one column per row: a cross-entropy's label), ``"max"`` (with argmax) and
``"softmax"`` (the softmax-weighted sum of values behind attention).

The results it relies on:

* the gradient of a reduction is a reduction of the same shape (KeOps: Charlier,
  Feydy, Glaunes, Collin, Durif, *Kernel operations on the GPU, with autodiff, without
  memory overflows*, JMLR 22, 2021): the backward is one more tiled pass that
  re-evaluates each tile under ``jax.vjp``;
* for ``logsumexp`` and ``softmax`` the forward keeps only the per-row result (and
  log-sum-exp), and the backward re-forms each tile's probabilities from it: the online
  softmax (Milakov & Gimelshein, arXiv:1805.02867; Rabe & Staats, arXiv:2112.05682) and
  the FlashAttention backward (Dao, Fu, Ermon, Rudra, Re, NeurIPS 2022).

Precision: every running quantity (the sum, the log-sum-exp statistics, the softmax
accumulators, and the backward's accumulated cotangents) is kept in at least float32
(:func:`accumulation_dtype`) and results are returned in the scores' own dtype, as
``jnp.sum`` does: summing 65,536 bfloat16 values in bfloat16 stalls at 2,048 with
8-value tiles. The accumulators are per-row or per-column vectors; a tile is only
widened inside the fused reduction that consumes it.

A batch of independent problems (attention's batch and heads) is one call: rows and
columns carry leading ``batch`` dims, and every tile is evaluated for the whole batch
at once (``vmap`` inside the loops). A pair operand (mask, bias) may broadcast over
batch dims, rows or columns; it is sliced from its own shape and its gradient is
reduced over the broadcast dims tile by tile, never materialised at full size.

Memory in both directions: inputs + outputs + one tile. The forward and backward tiles
are explicit in the :class:`~memwise.tiling.Tiling` the caller resolves. Tiles that
cannot hold a finite score (above a causal diagonal) are never visited: each loop runs
over the live blocks alone. Used by :func:`memwise.pairwise_reduce` (and so
:mod:`memwise.ot`) and :func:`memwise.attention`.

The package: :mod:`.reductions` (one object per reduction kind: every rule that
differs between sum, log-sum-exp, max and softmax), :mod:`.tiles` (the static spec and
block slicing), :mod:`.forward`, :mod:`.backward`, :mod:`.ring` (columns split over
devices), :mod:`.kernels` (the seam where a fused backend kernel may replace the
plain-JAX tile loops) and :mod:`.api` (:func:`tiled_reduce`). The dtype policy lives
on the ground floor, in :mod:`memwise._dtypes`.

Not optimal yet: forward mode (``jax.jvp``) is not supported (a ``custom_vjp``);
second derivatives work, but their memory is not bounded by a tile. With
``upcast=True`` the backward's tile matmuls run in float32 on float32 copies of each
block (what makes bfloat16 gradients as accurate as dense ones); fused attention
kernels instead feed bfloat16 operands to float32-accumulating matmuls, which is faster
on accelerators.
"""

from memwise._dtypes import accumulation_dtype, promote, sum_dtype
from memwise.engine import (
    tpu_attention,  # noqa: F401, E402  (registers its kernel)
    tpu_cross_entropy,  # noqa: F401, E402  (registers its kernels)
    tpu_dot_scores,  # noqa: F401, E402  (registers its kernel)
    tpu_pair_function,  # noqa: F401, E402  (registers its kernels)
)
from memwise.engine.api import tiled_reduce
from memwise.engine.reductions import REDUCTIONS, Reduction
from memwise.engine.ring import Ring

__all__ = [
    "REDUCTIONS",
    "Reduction",
    "Ring",
    "accumulation_dtype",
    "promote",
    "sum_dtype",
    "tiled_reduce",
]
