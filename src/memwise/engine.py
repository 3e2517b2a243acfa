"""The one 2-D tiled reduction engine, with a custom VJP whose backward is tiled too.

``tiled_reduce`` reduces the scores of every ``(row, column)`` pair over the columns,
one ``rows x cols`` tile at a time, and never holds more than a tile of scores in
either pass. The reductions are ``"sum"``, ``"logsumexp"``, ``"max"`` (with argmax) and
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
cannot hold a finite score (above a causal diagonal) are skipped by a ``lax.cond`` in
the one loop body. Used by :func:`memwise.pairwise_reduce` (and so :mod:`memwise.ot`)
and :func:`memwise.attention`.

Not optimal yet: forward mode (``jax.jvp``) is not supported (a ``custom_vjp``);
second derivatives work, but their memory is not bounded by a tile. With
``upcast=True`` the backward's tile matmuls run in float32 on float32 copies of each
block (what makes bfloat16 gradients as accurate as dense ones); fused attention
kernels instead feed bfloat16 operands to float32-accumulating matmuls, which is faster
on accelerators.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from memwise._vjp import (
    Static,
    add,
    cotangents,
    custom_vjp,
    dense,
    fill,
    guard_forward_mode,
    is_zero,
    select,
    unwrap,
)
from memwise.sharding import psum_replicated, typed_zeros, vary, varying_over
from memwise.tiling import Chunking, Tiling, leading_length

__all__ = ["REDUCTIONS", "Ring", "accumulation_dtype", "sum_dtype", "tiled_reduce"]

REDUCTIONS = ("sum", "logsumexp", "max", "softmax")

# The flattened leaves of one pytree operand (rows, cols, pairs or consts).
_Leaves = list[jax.Array]


def accumulation_dtype(dtype: Any) -> np.dtype:
    """The dtype a reduction of ``dtype`` values accumulates in: at least float32 for
    floating dtypes (float64 stays float64), ``dtype`` itself otherwise.

    Example::

        >>> accumulation_dtype(jnp.bfloat16), accumulation_dtype(jnp.int32)
        (dtype('float32'), dtype('int32'))
    """
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.inexact):
        return jnp.promote_types(dtype, jnp.float32)
    return dtype


def sum_dtype(dtype: Any) -> np.dtype:
    """The dtype ``jnp.sum`` returns for ``dtype`` values (floats keep theirs; bool and
    narrow integers widen to the default integer)."""
    return jax.eval_shape(jnp.sum, jax.ShapeDtypeStruct((0,), dtype)).dtype


def promote(tree: Any) -> Any:
    """``tree`` with its floating leaves cast to their :func:`accumulation_dtype`."""
    # jnp.asarray: a const may be a Python scalar (or JAX's typed float under checkpoint).
    return jax.tree.map(
        lambda a: jnp.asarray(a).astype(accumulation_dtype(jnp.result_type(a))), tree
    )


def _accumulators(values: Sequence[Any]) -> list:
    """Loop-carry zeros shaped like ``values``, in their accumulation dtype."""
    return [z.astype(accumulation_dtype(z.dtype)) for z in typed_zeros(values)]


_FORWARD_MODE = (
    "memwise's tiled reductions support reverse mode (grad, vjp, jacrev; also jax.hessian "
    "and jacfwd of grad) and vmap, but not forward mode through them (jvp, jacfwd, "
    "jax.linearize); for forward mode compute the dense version, or differentiate in "
    "reverse mode"
)


@dataclasses.dataclass(frozen=True, eq=False)
class _TileSpec:
    """Static description of one tiled reduction (a nondiff argument of the custom_vjp).

    ``tile_fn(rows, cols, pairs, consts, row_ids, col_ids)`` returns the scores of one
    tile of one problem, shape ``(R, C) + trailing``; for ``"softmax"`` it returns
    ``(scores (R, C), values (C, dv))`` and the reduction is ``sum_j softmax_j(scores)
    values_j``. Scores equal to -inf are excluded (masking).
    """

    tile_fn: Callable
    reduce: str
    tiles: Tiling
    trees: tuple  # treedefs of (rows, cols, pairs, consts)
    batch: tuple = ()  # leading batch dims of rows and cols
    # Per pair leaf: its leading batch dims, 1 where it broadcasts over that batch dim.
    pair_batch: tuple = ()
    # The same per column leaf (grouped-query attention: one K/V head for many heads);
    # empty when every column leaf has the full batch dims (then none is squeezed).
    col_batch: tuple = ()
    upcast: bool = False  # differentiate tiles on float32 copies of the blocks
    vary_consts: bool = True  # see memwise.sharding.convert
    # live(row_ids, col_ids, consts) -> bool scalar: False when every score of the tile is
    # -inf (e.g. above a causal diagonal); such tiles are skipped with lax.cond.
    live: Callable | None = None
    # The TypeError forward mode raises, naming the caller's public function and the fix.
    forward_mode_error: str = ""

    def tile(self, leaves: Sequence[list], row_ids: jax.Array, col_ids: jax.Array) -> Any:
        rows, cols, pairs, consts = (
            jax.tree.unflatten(tree, flat) for tree, flat in zip(self.trees, leaves)
        )
        return self.tile_fn(rows, cols, pairs, consts, row_ids, col_ids)

    def is_live(self, row_ids: jax.Array, col_ids: jax.Array, const_leaves: list) -> jax.Array:
        assert self.live is not None  # called only for a spec with live
        return self.live(row_ids, col_ids, jax.tree.unflatten(self.trees[3], const_leaves))

    def pair_axes(self, level: int) -> list:
        """vmap in_axes of the (squeezed) pair leaves at batch dim ``level``."""
        return [None if pb[level] == 1 else 0 for pb in self.pair_batch]

    def col_axes(self, level: int) -> list:
        """vmap in_axes of the (squeezed) column leaves at batch dim ``level``."""
        if not self.col_batch:
            return [0] * self.trees[1].num_leaves
        return [None if cb[level] == 1 else 0 for cb in self.col_batch]

    def squeeze_pairs(self, pairs: list) -> list:
        """Pair leaves without the batch dims they broadcast over (a reshape, no copy)."""
        return _squeeze(pairs, self.pair_batch, len(self.batch))

    def squeeze_cols(self, cols: list) -> list:
        """Column leaves without the batch dims they broadcast over (no copy)."""
        if not self.col_batch:
            return list(cols)
        return _squeeze(cols, self.col_batch, len(self.batch))

    def col_lead(self) -> list:
        """Per squeezed column leaf: the axis of its columns."""
        if not self.col_batch:
            return [len(self.batch)] * self.trees[1].num_leaves
        return [sum(s != 1 for s in cb) for cb in self.col_batch]

    def over_batch(
        self, fn: Callable, in_axes: Callable[[int], tuple], out_axes: Any = 0
    ) -> Callable:
        """``fn`` of one problem vmapped over the batch dims, outermost first."""
        for level in reversed(range(len(self.batch))):
            fn = jax.vmap(fn, in_axes=in_axes(level), out_axes=out_axes)
        return fn


def _squeeze(leaves: list, leaf_batch: tuple, nb: int) -> list:
    """Each leaf without the leading batch dims it broadcasts over (size 1 in ``leaf_batch``)."""
    return [
        a.reshape(tuple(s for s in lb if s != 1) + a.shape[nb:])
        for a, lb in zip(leaves, leaf_batch)
    ]


def _expand(a: jax.Array, ndim: int) -> jax.Array:
    """Append singleton axes so a per-row ``(R,)`` array broadcasts against ``ndim`` dims."""
    return a.reshape(a.shape + (1,) * (ndim - a.ndim))


def _pair_blocks(
    rows: Chunking,
    cols: Chunking,
    pairs: list,
    i_start: int | jax.Array,
    j_start: int | jax.Array,
    lead: Sequence[int] | None = None,
) -> list:
    """The tile of each pair operand at ``(i_start, j_start)``, no copy.

    A pair's row and column axes sit after its ``lead`` batch dims; an axis of size 1
    broadcasts (a key-padding mask is ``(1, m)``) and is not sliced.
    """
    out = []
    for p, k in zip(pairs, lead or [0] * len(pairs)):
        if p.shape[k] != 1:
            p = rows.block(p, i_start, axis=k)
        if p.shape[k + 1] != 1:
            p = cols.block(p, j_start, axis=k + 1)
        out.append(p)
    return out


def _safe_max(m: jax.Array) -> jax.Array:
    return jnp.where(jnp.isfinite(m), m, 0.0)


def _tile_type(
    spec: _TileSpec, rows: _Leaves, cols: _Leaves, pairs: _Leaves, consts: _Leaves
) -> Any:
    """Shapes and dtypes of one tile's output (the first tile of the first problem)."""
    R, C, nb = spec.tiles.rows, spec.tiles.cols, len(spec.batch)

    def first_tile():
        r = [R.block(a[(0,) * nb], 0) for a in rows]
        c = [C.block(a[(0,) * k], 0) for a, k in zip(cols, spec.col_lead())]
        lead = [sum(s != 1 for s in pb) for pb in spec.pair_batch]
        p = _pair_blocks(R, C, [a[(0,) * k] for a, k in zip(pairs, lead)], 0, 0)
        return spec.tile((r, c, p, consts), R.chunk_ids(0)[0], C.chunk_ids(0)[0])

    return jax.eval_shape(first_tile)


def _finish(reduce: str, first: Any, stats: Any) -> tuple[Any, Any]:
    """``(result, residual)`` from the forward's statistics (accumulation dtypes): the
    result in the scores' dtype (``jnp.sum``'s for a sum), the residual what the
    backward needs. Where the dtypes agree they are one buffer."""
    if reduce == "sum":
        return stats.astype(sum_dtype(first.dtype)), None
    if reduce == "logsumexp":
        return stats.astype(first.dtype), stats  # the float32 log-sum-exp
    if reduce == "max":
        return stats, stats[1]  # the argmax
    s_type, v_type = first[:2]
    out, lse = stats
    # The backward's rowsum(dO * O) needs the unrounded output: with a bfloat16 one, dq
    # and dk came out up to 1.4x less accurate than dense attention's.
    return (out.astype(v_type.dtype), lse.astype(s_type.dtype)), (out, lse)


def _row_pass(
    spec: _TileSpec,
    first: Any,
    rows: Any,
    cols: Any,
    pairs: _Leaves,
    consts: _Leaves,
    row_ids: jax.Array,
) -> Any:
    """Reduce one row block over all column tiles (the forward pass of one row block).

    ``first`` is the tile's output type. Returns the statistics :func:`_finish` turns
    into the result: in the accumulation dtype (the max: the scores' own, and argmax).
    """
    reduce = spec.reduce

    def scores_of(col_blk, c_ids):
        pblk = _pair_blocks(spec.tiles.rows, spec.tiles.cols, pairs, row_ids[0], c_ids[0])
        return spec.tile((rows, col_blk, pblk, consts), row_ids, c_ids)

    init: Any
    if reduce == "softmax":
        s_shape, v_shape = first[:2]
        acc_dtype = accumulation_dtype(s_shape.dtype)
        R = s_shape.shape[0]
        init = (
            jnp.full((R,), -jnp.inf, acc_dtype),
            jnp.zeros((R,), acc_dtype),
            jnp.zeros((R,) + v_shape.shape[1:], accumulation_dtype(v_shape.dtype)),
        )
    else:
        R, trailing, dtype = first.shape[0], first.shape[2:], first.dtype
        acc_dtype = accumulation_dtype(sum_dtype(dtype) if reduce == "sum" else dtype)
        if reduce == "sum":
            init = jnp.zeros((R,) + trailing, acc_dtype)
        elif reduce == "logsumexp":
            init = (
                jnp.full((R,) + trailing, -jnp.inf, acc_dtype),
                jnp.zeros((R,) + trailing, acc_dtype),
            )
        else:  # max: exact in any dtype
            init = (
                jnp.full((R,) + trailing, -jnp.inf, dtype),
                jnp.zeros((R,) + trailing, jnp.int32),
            )

    init = vary(init, varying_over(rows, cols, pairs, consts))

    def body(state, k):
        # Column blocks sliced by index from the unsplit columns: splitting them into
        # (chunks, size, ...) made a copy (under vmap, a transposed one) of k and v.
        col_blk = [spec.tiles.cols.block(a, k * spec.tiles.cols.size) for a in cols]
        inp = (col_blk, *spec.tiles.cols.chunk_ids(k))
        if spec.live is None:
            return step(state, inp), None
        # The predicate depends on tile indices only (never on vmapped data), so under
        # vmap this stays a real branch and a dead tile costs nothing.
        keep = spec.is_live(row_ids, inp[1], consts)
        return lax.cond(keep, step, lambda s, _: s, state, inp), None

    def step(state, inp):
        col_blk, c_ids, c_valid = inp
        out = scores_of(col_blk, c_ids)
        if reduce == "softmax":
            s, vals = out[:2]
            # Widened inside the fused exp/sum only; the tile itself stays as produced.
            s = jnp.where(c_valid[None, :], s, -jnp.inf).astype(acc_dtype)
            m, denom, acc = state
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            shift = _safe_max(m_new)
            p = jnp.exp(s - shift[:, None])
            scale = jnp.exp(m - shift)
            denom = denom * scale + jnp.sum(p, axis=1)
            # Value weights (dropout) scale the sum of values, not the denominator.
            pw = p if len(out) == 2 else p * out[2].astype(acc_dtype)
            acc = acc * _expand(scale, acc.ndim).astype(acc.dtype) + jnp.tensordot(
                pw, vals.astype(acc.dtype), 1
            )
            return (m_new, denom, acc)
        s = out
        valid = _expand(c_valid[None, :], s.ndim)
        if reduce == "sum":
            return state + jnp.sum(jnp.where(valid, s, 0), axis=1, dtype=acc_dtype)
        if reduce == "logsumexp":
            m, denom = state
            s = jnp.where(valid, s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=1).astype(acc_dtype))
            shift = _safe_max(m_new)
            p = jnp.exp(s.astype(acc_dtype) - jnp.expand_dims(shift, 1))
            denom = denom * jnp.exp(m - shift) + jnp.sum(p, axis=1)
            return (m_new, denom)
        m, arg = state
        s = jnp.where(valid, s, -jnp.inf)
        # jnp.argmax / jnp.max semantics: the first NaN wins and propagates.
        tile_arg = jnp.argmax(s, axis=1)
        tile_max = jnp.max(s, axis=1)
        better = (tile_max > m) | (jnp.isnan(tile_max) & ~jnp.isnan(m))
        arg = jnp.where(better, c_ids[tile_arg].astype(jnp.int32), arg)
        return (jnp.where(better, tile_max, m), arg)

    state, _ = lax.scan(body, init, spec.tiles.cols.indices())
    if reduce in ("sum", "max"):
        return state
    if reduce == "logsumexp":
        m, denom = state
        return _safe_max(m) + jnp.log(denom)
    m, denom, acc = state
    lse = _safe_max(m) + jnp.log(denom)
    return acc / _expand(jnp.where(denom > 0, denom, 1.0), acc.ndim), lse


def _problem_forward(
    spec: _TileSpec, first: Any, rows: Any, cols: Any, pairs: _Leaves, consts: _Leaves
) -> Any:
    """The forward statistics of one problem (no batch dims)."""
    R = spec.tiles.rows

    # Row blocks sliced by index, as the columns' and the backward's: splitting rows
    # into (chunks, size, ...) copied q (transposed, under the batch's vmap).
    def one_row_block(k):
        row_blk = [R.block(a, k * R.size) for a in rows]
        return _row_pass(spec, first, row_blk, cols, pairs, consts, R.chunk_ids(k)[0])

    # Each block's statistics written in place into a carried buffer: stacking them as
    # the loop's output and merging made two more copies (under vmap, transposed).
    block_type = jax.eval_shape(one_row_block, jnp.int32(0))
    init = jax.tree.map(lambda t: jnp.zeros((R.padded,) + t.shape[1:], t.dtype), block_type)
    init = vary(init, varying_over(rows, cols, pairs, consts))

    def body(acc, k):
        blk = one_row_block(k)
        start = k * R.size
        return jax.tree.map(
            lambda a, b: lax.dynamic_update_slice_in_dim(a, b, start, axis=0), acc, blk
        ), None

    out, _ = lax.scan(body, init, R.indices())
    return jax.tree.map(lambda a: a[: R.length], out)


def _statistics(
    spec: _TileSpec, rows: _Leaves, cols: _Leaves, pairs: _Leaves, consts: _Leaves
) -> tuple[Any, Any]:
    """``(tile type, statistics)`` of the whole batch: each problem vmapped, pairs
    broadcast over the batch dims they lack (never expanded)."""
    pairs = spec.squeeze_pairs(pairs)
    cols = spec.squeeze_cols(cols)
    first = _tile_type(spec, rows, cols, pairs, consts)
    problem = spec.over_batch(
        lambda r, c, p: _problem_forward(spec, first, r, c, p, consts),
        lambda level: (0, spec.col_axes(level), spec.pair_axes(level)),
    )
    return first, problem(rows, cols, pairs)


def _tiled_forward(
    spec: _TileSpec, rows: _Leaves, cols: _Leaves, pairs: _Leaves, consts: _Leaves
) -> tuple[Any, Any]:
    """``(result, residual)`` of the whole batch."""
    first, stats = _statistics(spec, rows, cols, pairs, consts)
    return _finish(spec.reduce, first, stats)


@functools.partial(
    custom_vjp, nondiff_argnums=(0,), forward_mode_error=lambda spec: spec.forward_mode_error
)
def _tiled_core(
    spec: _TileSpec, rows: _Leaves, cols: _Leaves, pairs: _Leaves, consts: _Leaves
) -> Any:
    return _tiled_forward(spec, rows, cols, pairs, consts)[0]


def _tiled_core_fwd(spec, *primals):
    values, flags = zip(*(unwrap(p) for p in primals))
    out, residual = _tiled_forward(spec, *values)
    return out, (values, residual, Static(flags))


def _tiled_core_bwd(spec, res, ct):
    values, residual, flags = res
    return _backward(spec, values, residual, flags.value, ct)


def _backward(spec, values, residual, flags, ct, running=None):
    """The tiled backward pass: the cotangents of ``values`` (``None`` where a flag is
    off). With ``running`` (a ring's accumulators, see :func:`_ring_core_bwd`), this
    pass adds into them instead and returns them, padded, in the accumulation dtype."""
    rows, cols, pairs, consts = values
    R, C = spec.tiles.backward_rows, spec.tiles.backward_cols
    reduce = spec.reduce
    nb = len(spec.batch)

    # Per-row quantities the backward needs: the cotangent and the saved statistics.
    if reduce == "softmax":
        out, lse = residual
        ct_out = dense(ct[0], out)
        ct_lse = dense(ct[1], lse).astype(lse.dtype)
        trailing = tuple(range(nb + 1, out.ndim))
        delta = jnp.sum(ct_out.astype(lse.dtype) * out, axis=trailing)
        per_row = [ct_out, ct_lse - delta, lse]
    else:
        value_ct = ct[0] if reduce == "max" else ct
        if is_zero(value_ct):  # zeros of the result's own dtype (int for an int sum)
            like = jax.eval_shape(lambda: _tiled_forward(spec, *values)[0])
            value_ct = dense(value_ct, like[0] if reduce == "max" else like)
        per_row = [value_ct]
        if reduce in ("logsumexp", "max"):
            per_row.append(residual)  # the float32 log-sum-exp; the argmax

    row_f, col_f, pair_f, const_f = flags
    axes = varying_over(values, per_row)
    primals = values
    # Replicated inputs enter the loops as varying copies so that each tile's vjp yields
    # a local partial cotangent; psum_replicated all-reduces once at the end.
    rows, cols, pairs = vary(values[:3], axes)
    consts = vary(values[3], axes) if spec.vary_consts else values[3]
    if spec.upcast:
        consts = promote(consts)
    pairs = spec.squeeze_pairs(pairs)
    cols = spec.squeeze_cols(cols)
    # A pair's row/column axes follow the batch dims it does not broadcast over; so does
    # a column leaf's column axis.
    lead = [sum(s != 1 for s in pb) for pb in spec.pair_batch]
    col_lead = spec.col_lead()

    # Blocks are sliced by index from the unpadded arrays (splitting into (chunks, size,
    # ...) copied q once more), and cotangents are written in place into padded carries;
    # slots past the end are masked (zero cotangent), then sliced off.
    def padded(a, chunks, dtype, k=nb):
        shape = a.shape[:k] + (chunks.padded,) + a.shape[k + 1 :]
        return vary(jnp.zeros(shape, dtype), axes)

    def pair_accumulator(p, k):
        shape = list(p.shape)
        full_rows, full_cols = shape[k] == R.length, shape[k + 1] == C.length
        shape[k] = R.padded if full_rows else 1
        shape[k + 1] = C.padded if full_cols else 1
        # A full pair gets each element once; one broadcast over rows or columns sums
        # one contribution per tile, in the accumulation dtype.
        once = (full_rows or R.length == 1) and (full_cols or C.length == 1)
        dtype = jnp.result_type(p) if once else accumulation_dtype(jnp.result_type(p))
        return vary(jnp.zeros(shape, dtype), axes)

    if running is None:
        d_rows0 = [padded(a, R, a.dtype) for a in select(rows, row_f)]
        d_cols0 = [
            padded(a, C, accumulation_dtype(a.dtype), k)
            for a, k in zip(select(cols, col_f), select(col_lead, col_f))
        ]
        d_pairs0 = [
            pair_accumulator(p, k) for p, k in zip(select(pairs, pair_f), select(lead, pair_f))
        ]
        d_consts0 = _accumulators(select(consts, const_f))
    else:
        d_rows0, d_cols0, d_pairs0, d_consts0 = running
    # One tile of every problem in the batch at once.
    tile_in_axes = lambda level: (0, spec.col_axes(level), spec.pair_axes(level), None)  # noqa: E731

    def row_body(carry, inp):
        d_rows, d_cols, d_pairs, d_consts = carry
        r_ids, r_valid = R.chunk_ids(inp)
        r0 = r_ids[0]
        row_blk = [R.block(a, r0, axis=nb) for a in rows]
        row_data = [R.block(a, r0, axis=nb) for a in per_row]

        def col_body(carry2, inp2):
            d_row, d_cols, d_pairs, d_consts = carry2
            c_ids, c_valid = C.chunk_ids(inp2)
            c0 = c_ids[0]
            col_blk = [C.block(a, c0, axis=k) for a, k in zip(cols, col_lead)]
            pblk = _pair_blocks(R, C, pairs, r0, c0, lead)
            blocks = [row_blk, col_blk, pblk]
            if spec.upcast:
                blocks = promote(blocks)
            tile = spec.over_batch(
                lambda r, c, p, k: spec.tile((r, c, p, k), r_ids, c_ids), tile_in_axes
            )

            def f(r_d, c_d, p_d, k_d):
                return tile(
                    fill(blocks[0], row_f, r_d),
                    fill(blocks[1], col_f, c_d),
                    fill(blocks[2], pair_f, p_d),
                    fill(consts, const_f, k_d),
                )

            primal_in = (
                select(blocks[0], row_f),
                select(blocks[1], col_f),
                select(blocks[2], pair_f),
                select(consts, const_f),
            )
            score_ct = spec.over_batch(
                lambda out, rd: _score_cotangent(reduce, out, rd, r_valid, c_valid, c_ids),
                lambda level: (0, 0),
            )

            def tile_grads():
                out, vjp = jax.vjp(f, *primal_in)
                return vjp(score_ct(out, row_data))

            if spec.live is None:
                dr, dc, dp, dk = tile_grads()
            else:
                # Only the tile's cotangents are branched (not the carried accumulators),
                # so the cond never copies an O(n) or O(n m) buffer.
                dr, dc, dp, dk = lax.cond(
                    spec.is_live(r_ids, c_ids, consts),
                    tile_grads,
                    lambda: tuple(typed_zeros(group) for group in primal_in),
                )
            d_row = add(d_row, dr)
            d_cols = [
                _add_block(acc, g, (c0,), k)
                for acc, g, k in zip(d_cols, dc, select(col_lead, col_f))
            ]
            d_pairs = [
                _add_block(acc, g, (r0, c0), k)
                for acc, g, k in zip(d_pairs, dp, select(lead, pair_f))
            ]
            return (d_row, d_cols, d_pairs, add(d_consts, dk)), None

        (d_row, d_cols, d_pairs, d_consts), _ = lax.scan(
            col_body,
            (_accumulators(select(row_blk, row_f)), d_cols, d_pairs, d_consts),
            C.indices(),
        )
        if running is None:
            # A row block's cotangent is complete here: stored once, in its own dtype.
            d_rows = [
                lax.dynamic_update_slice_in_dim(acc, g.astype(acc.dtype), r0, axis=nb)
                for acc, g in zip(d_rows, d_row)
            ]
        else:  # one column block of a ring: add to the other blocks' share
            d_rows = [_add_block(acc, g, (r0,), nb) for acc, g in zip(d_rows, d_row)]
        return (d_rows, d_cols, d_pairs, d_consts), None

    (d_rows, d_cols, d_pairs, d_consts), _ = lax.scan(
        row_body, (d_rows0, d_cols0, d_pairs0, d_consts0), R.indices()
    )
    if running is not None:
        return d_rows, d_cols, d_pairs, d_consts

    def finish(cts, primal_group):
        return [c.astype(p.dtype) for c, p in zip(psum_replicated(cts, primal_group), primal_group)]

    d_rows = finish(
        [lax.slice_in_dim(a, 0, R.length, axis=nb) for a in d_rows], select(primals[0], row_f)
    )
    primal_cols = select(primals[1], col_f)
    d_cols = [
        lax.slice_in_dim(a, 0, C.length, axis=k) for a, k in zip(d_cols, select(col_lead, col_f))
    ]
    d_cols = [
        d.reshape(p.shape)
        for d, p in zip(finish(d_cols, select(spec.squeeze_cols(primals[1]), col_f)), primal_cols)
    ]
    d_pairs = [
        lax.slice(a, (0,) * a.ndim, p.shape[:k] + p.shape[k : k + 2] + a.shape[k + 2 :])
        for a, p, k in zip(d_pairs, select(pairs, pair_f), select(lead, pair_f))
    ]
    primal_pairs = select(primals[2], pair_f)
    d_pairs = [d.reshape(p.shape) for d, p in zip(finish(d_pairs, primal_pairs), primal_pairs)]
    d_consts = finish(d_consts, select(primals[3], const_f))
    return (
        cotangents(row_f, d_rows),
        cotangents(col_f, d_cols),
        cotangents(pair_f, d_pairs),
        cotangents(const_f, d_consts),
    )


def _add_block(acc, g, starts, k):
    """Add a block's cotangent ``g`` into ``acc`` at ``starts`` on axes ``k, k+1, ...``
    (at 0 on an axis of size 1: a pair that broadcasts over it)."""
    starts = tuple(i if n != 1 else 0 for i, n in zip(starts, acc.shape[k:]))
    zero = jnp.zeros((), jnp.int32)  # one index dtype (python 0s are int64 under x64)
    start = (zero,) * k + tuple(jnp.asarray(i, jnp.int32) for i in starts)
    start += (zero,) * (acc.ndim - len(start))
    cur = lax.dynamic_slice(acc, start, g.shape)
    return lax.dynamic_update_slice(acc, cur + g.astype(acc.dtype), start)


def _score_cotangent(reduce, out, row_data, r_valid, c_valid, c_ids):
    """d(result)/d(tile scores) contracted with the per-row cotangent: one tile's worth.

    Computed in the accumulation dtype and returned in the tile's own dtypes. Padding
    rows and columns get exactly zero (their scores may overflow ``exp``).
    """
    if reduce == "softmax":
        s, vals = out[:2]
        ct_out, ct_lse_minus_delta, lse = row_data
        acc = lse.dtype
        valid = c_valid[None, :] & (r_valid & jnp.isfinite(lse))[:, None]
        p = jnp.where(valid, jnp.exp(s.astype(acc) - _safe_max(lse)[:, None]), 0.0)
        ct2 = ct_out.reshape(ct_out.shape[0], -1).astype(acc)
        v2 = vals.reshape(vals.shape[0], -1).astype(acc)
        dp = ct2 @ v2.T
        # With value weights w: out = sum_j p_j w_j v_j, so d/ds_j = p_j (w_j dp_j - delta)
        # (FlashAttention's dropout backward); the weights themselves get no gradient.
        pw = p if len(out) == 2 else p * out[2].astype(acc)
        if len(out) == 3:
            dp = dp * out[2].astype(acc)
        ds = p * (dp + ct_lse_minus_delta[:, None])
        d_vals = (pw.T @ ct2).reshape(vals.shape).astype(vals.dtype)
        if len(out) == 2:
            return ds.astype(s.dtype), d_vals
        return ds.astype(s.dtype), d_vals, jnp.zeros_like(out[2])
    s = out
    ct_row = row_data[0]
    valid = _expand(c_valid[None, :] & r_valid[:, None], s.ndim)
    if reduce == "sum":
        ct_b = jnp.expand_dims(ct_row, 1).astype(s.dtype)
        return jnp.where(valid, jnp.broadcast_to(ct_b, s.shape), 0)
    if reduce == "logsumexp":
        lse = jnp.expand_dims(row_data[1], 1)
        live = valid & jnp.isfinite(lse)
        ct_b = jnp.expand_dims(ct_row, 1).astype(lse.dtype)
        w = jnp.exp(s.astype(lse.dtype) - _safe_max(lse))
        return jnp.where(live, ct_b * w, 0).astype(s.dtype)
    arg = jnp.expand_dims(row_data[1], 1)
    hit = _expand(c_ids[None, :], s.ndim) == arg
    ct_b = jnp.expand_dims(ct_row, 1).astype(s.dtype)
    return jnp.where(valid & hit, jnp.broadcast_to(ct_b, s.shape), 0)


_tiled_core.defvjp(_tiled_core_fwd, _tiled_core_bwd)


# ---------------------------------------------------------------------------------------
# Rings: the columns split over a mesh axis too, each block passed around the devices.


@dataclasses.dataclass(frozen=True)
class Ring:
    """Inside ``shard_map``: the mesh axis (or axes) the columns are split over, and its
    number of devices. Every device holds ``m / size`` columns; block by block they
    travel to the next device (``ppermute``) while the current one is reduced."""

    axes: Any
    size: int


def _ring_spec(spec: _TileSpec) -> _TileSpec:
    """``spec`` for one column block of a ring: its consts gain the block's first global
    column, added to the column ids ``tile_fn`` and ``live`` see (a causal mask compares
    global positions); the loops still slice with block-local ids."""
    tile_fn, live = spec.tile_fn, spec.live

    def shifted(rows, cols, pairs, consts, row_ids, col_ids):
        user, offset = consts
        return tile_fn(rows, cols, pairs, user, row_ids, col_ids + offset)

    def shifted_live(row_ids, col_ids, consts):
        assert live is not None  # installed only when spec has live
        user, offset = consts
        return live(row_ids, col_ids + offset, user)

    user = jax.tree.unflatten(spec.trees[3], [0] * spec.trees[3].num_leaves)
    return dataclasses.replace(
        spec,
        tile_fn=shifted,
        live=None if live is None else shifted_live,
        trees=spec.trees[:3] + (jax.tree.structure((user, 0)),),
    )


def _rotate(tree: Any, ring: Ring) -> Any:
    """Every device's ``tree`` sent to the next device of the ring."""
    perm = [(i, (i + 1) % ring.size) for i in range(ring.size)]
    return jax.tree.map(lambda a: lax.ppermute(a, ring.axes, perm), tree)


def _block_offset(ring: Ring, m_local: int, step: int | jax.Array) -> jax.Array:
    """The first global column of the block a device holds at ``step``: it started on
    the device ``step`` places before this one."""
    me = lax.axis_index(ring.axes)
    return (((me - step) % ring.size) * m_local).astype(jnp.int32)


def _combine(reduce: str, a: Any, b: Any) -> Any:
    """The statistics of two column blocks' reductions, merged (associative)."""
    if reduce == "sum":
        return a + b
    if reduce == "logsumexp":
        return jnp.logaddexp(a, b)
    if reduce == "max":
        (va, ia), (vb, ib) = a, b
        # jnp.max/argmax over the union: the larger value, the first index on ties, and
        # the first NaN wins (blocks arrive in ring order, not column order).
        better = (
            (vb > va) | ((vb == va) & (ib < ia)) | (jnp.isnan(vb) & (~jnp.isnan(va) | (ib < ia)))
        )
        return jnp.where(better, vb, va), jnp.where(better, ib, ia)
    (oa, la), (ob, lb) = a, b
    lse = jnp.logaddexp(la, lb)
    shift = _safe_max(lse)
    wa, wb = (_expand(jnp.exp(w - shift), oa.ndim) for w in (la, lb))
    return oa * wa.astype(oa.dtype) + ob * wb.astype(ob.dtype), lse


def _ring_statistics(
    spec: _TileSpec, ring: Ring, rows: _Leaves, cols: _Leaves, pairs: _Leaves, consts: _Leaves
) -> tuple[Any, Any]:
    """``(tile type, statistics over every device's columns)``."""
    m_local = cols[0].shape[len(spec.batch)]

    def block(blk, step):
        offset = _block_offset(ring, m_local, step)
        first, stats = _statistics(spec, rows, blk, pairs, [*consts, offset])
        if spec.reduce == "max":
            stats = (stats[0], stats[1] + offset)
        return first, stats

    in_flight = _rotate(cols, ring)  # the next block travels while this one is reduced
    first, stats = block(cols, 0)

    def step(carry, i):
        blk, stats = carry
        in_flight = _rotate(blk, ring)  # (the last step's send is not used)
        return (in_flight, _combine(spec.reduce, stats, block(blk, i)[1])), None

    (_, stats), _ = lax.scan(step, (in_flight, stats), jnp.arange(1, ring.size))
    return first, stats


@functools.partial(
    custom_vjp,
    nondiff_argnums=(0, 1),
    forward_mode_error=lambda spec, _ring: spec.forward_mode_error,
)
def _ring_core(
    spec: _TileSpec, ring: Ring, rows: _Leaves, cols: _Leaves, pairs: _Leaves, consts: _Leaves
) -> Any:
    return _finish(spec.reduce, *_ring_statistics(spec, ring, rows, cols, pairs, consts))[0]


def _ring_core_fwd(spec, ring, *primals):
    values, flags = zip(*(unwrap(p) for p in primals))
    out, residual = _finish(spec.reduce, *_ring_statistics(spec, ring, *values))
    return out, (values, residual, Static(flags))


def _ring_core_bwd(spec, ring, res, ct):
    """The tiled backward of each block against the global statistics, the block and
    its cotangent travelling on together: after ``size`` steps every block is home with
    the cotangent summed over every device's rows (ring attention's backward). The
    tile loops add straight into the carried accumulators (no per-block copies)."""
    values, residual, flags = res
    row_f, col_f, pair_f, const_f = flags.value
    rows, cols, pairs, consts = values
    nb = len(spec.batch)
    m_local = cols[0].shape[nb]
    R, C = spec.tiles.backward_rows, spec.tiles.backward_cols
    block_flags = (row_f, col_f, pair_f, const_f + (False,))

    def padded(a, chunks):
        shape = a.shape[:nb] + (chunks.padded,) + a.shape[nb + 1 :]
        return jnp.zeros(shape, accumulation_dtype(a.dtype))

    def step(carry, i):
        blk, d_blk, d_rows, d_consts = carry
        in_flight = _rotate(blk, ring)
        offset = _block_offset(ring, m_local, i)
        # The global argmax as an index into this block (out of range: another block's).
        res_b = residual - offset if spec.reduce == "max" else residual
        d_rows, d_blk, _, d_consts = _backward(
            spec,
            (rows, blk, pairs, [*consts, offset]),
            res_b,
            block_flags,
            ct,
            running=(d_rows, d_blk, [], d_consts),
        )
        return (in_flight, _rotate(d_blk, ring), d_rows, d_consts), None  # d_blk follows

    init = (
        list(cols),
        [padded(a, C) for a in select(cols, col_f)],
        [padded(a, R) for a in select(rows, row_f)],
        _accumulators(select(consts, const_f)),
    )
    (_, d_blk, d_rows, d_consts), _ = lax.scan(step, init, jnp.arange(ring.size))

    def finish(cts, group, f, chunks=None):
        if chunks is not None:
            cts = [lax.slice_in_dim(c, 0, chunks.length, axis=nb) for c in cts]
        return cotangents(f, [c.astype(p.dtype) for c, p in zip(cts, select(group, f))])

    return (
        finish(d_rows, rows, row_f, R),
        finish(d_blk, cols, col_f, C),
        cotangents(pair_f, []),
        finish(d_consts, consts, const_f),
    )


_ring_core.defvjp(_ring_core_fwd, _ring_core_bwd)


def _item_length(tree: Any, batch: tuple, arg: str, broadcast: bool = False) -> int:
    """The common length of the axis after the ``batch`` dims of every leaf of ``tree``
    (with ``broadcast``, a leaf's batch dim may also be 1)."""
    nb = len(batch)
    for leaf in jax.tree.leaves(tree):
        lead = np.shape(leaf)[:nb]
        if len(lead) != nb or any(
            s != b and not (broadcast and s == 1) for s, b in zip(lead, batch)
        ):
            more = " (or 1 to broadcast)" if broadcast else ""
            raise ValueError(
                f"every leaf of {arg} needs leading batch dims {batch}{more}, got {np.shape(leaf)}"
            )
    items = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a)[nb:], jnp.result_type(a)), tree)
    return leading_length(items, arg)


def tiled_reduce(
    tile_fn: Callable,
    rows: Any,
    cols: Any,
    *,
    reduce: str,
    tiles: Tiling,
    pairs: Any = (),
    consts: Any = (),
    batch: tuple[int, ...] = (),
    upcast: bool = False,
    vary_consts: bool = True,
    live: Callable | None = None,
    ring: Ring | None = None,
    forward_mode_error: str = _FORWARD_MODE,
) -> Any:
    """The engine: reduce tile scores over columns, for every row, tile by tile.

    ``tile_fn(rows_blk, cols_blk, pairs_blk, consts, row_ids, col_ids)`` returns the
    scores of one ``(R, C)`` tile (trailing dims allowed; ``-inf`` = excluded), or for
    ``reduce="softmax"`` a pair ``(scores (R, C), values (C, ...))`` or a triple that
    adds value weights ``(R, C)``: the result is then ``sum_j p_j w_j v_j`` with ``p``
    the softmax of the scores (dropout's ``keep / (1 - rate)``: the denominator is
    unchanged; the weights get no gradient). ``rows`` and
    ``cols`` are pytrees with leading lengths n and m; ``pairs`` have leading ``(n, m)``
    (or 1 on an axis they broadcast over) and are sliced tile by tile without a copy;
    ``consts`` are passed whole. Gradients flow to all four (``tile_fn`` must not close
    over traced arrays; pass them in ``consts``). Results: ``"sum"``/``"logsumexp"``:
    ``(n,) + trailing``; ``"max"``: ``(values, argmax)`` (NaN propagates, and wins the
    argmax, as in ``jnp.max``/``jnp.argmax``); ``"softmax"``: ``(out (n, ...), lse
    (n,))``. Reductions accumulate in at least float32 and return the scores' dtype
    (``out``: the values' dtype).

    ``batch`` (optional) is a shape of independent problems: every leaf of ``rows`` and
    ``cols`` then has leading dims ``batch``, every leaf of ``pairs`` as many leading
    dims, each equal to the batch dim or 1 to broadcast over it, and the results gain
    leading ``batch`` dims. ``tile_fn`` still sees one problem; each tile is evaluated
    for the whole batch at once (``vmap``), and the gradient of a broadcast pair is
    summed tile by tile. A leaf of ``cols`` may have 1 for a batch dim too: it serves
    every problem along that dim without being repeated (grouped-query attention's
    K/V head for its group of query heads), and its gradient has its own size.

    ``tiles`` is the resolved :class:`~memwise.tiling.Tiling` (from
    :func:`~memwise.tiling.tiling`, so n and m must be >= 1): the forward pass runs its
    ``rows x cols`` tiles, the backward pass its ``backward_rows x backward_cols`` tiles.

    ``upcast=True`` evaluates the backward's tiles on copies of the blocks (and consts)
    promoted to :func:`accumulation_dtype`, so bfloat16/float16 cotangents are summed
    without being rounded once per tile; ``tile_fn`` must then accept any float dtype.

    Inside ``shard_map``, pass ``vary_consts=False`` when ``tile_fn`` evaluates a jaxpr
    traced with replicated ``consts`` (e.g. from ``jax.closure_convert``).

    ``live(row_ids, col_ids, consts) -> bool scalar`` (optional) marks tiles that can
    hold a finite score; the others are skipped (``lax.cond`` in the one loop body,
    forward and backward). It must depend on the indices and ``consts`` only: a causal
    mask halves the work this way.

    ``ring`` (inside ``shard_map`` only): ``cols`` is this device's block of columns
    split over ``ring.axes``; the blocks travel around the devices (``ppermute``), each
    reduced against the local rows while the next is in flight, and in the backward
    each block's cotangent travels with it back to its owner. Memory per device: the
    local rows, one block of columns (two while one is in flight) and one tile. The
    results are over every device's columns (argmax: global indices); ``tiles`` are
    resolved for one block, and ``tile_fn``/``live`` see global column ids. ``pairs``
    are not supported with a ring.

    Forward mode (``jax.jvp``, ``jax.jacfwd``, ``jax.linearize``) through the engine
    raises ``TypeError(forward_mode_error)``: pass a message naming the public function
    and what to use instead. Reverse mode, ``jax.hessian`` and ``jacfwd`` of ``grad``
    work.

    Example::

        >>> from memwise.tiling import tiling
        >>> x = jnp.arange(6.0)
        >>> add = lambda r, c, _p, _k, _ri, _ci: r[:, None] + c[None, :]
        >>> tiled_reduce(add, x, x, reduce="max", tiles=tiling(6, 6, 4))[0]
        Array([ 5.,  6.,  7.,  8.,  9., 10.], dtype=float32)
    """
    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce must be one of {REDUCTIONS}, got {reduce!r}")
    if not isinstance(tiles, Tiling):
        raise TypeError(f"tiles must be a memwise.tiling.Tiling (from tiling()), got {tiles!r}")
    batch = tuple(int(b) for b in batch)
    nb = len(batch)
    shape = (_item_length(rows, batch, "rows"), _item_length(cols, batch, "cols", True))
    if tiles.shape != shape:
        raise ValueError(f"tiles were resolved for {tiles.shape}, but rows x cols is {shape}")
    pair_batch = []
    for p in jax.tree.leaves(pairs):
        ps = np.shape(p)
        if (
            len(ps) < nb + 2
            or any(s not in (1, b) for s, b in zip(ps, batch))
            or ps[nb] not in (1, shape[0])
            or ps[nb + 1] not in (1, shape[1])
        ):
            raise ValueError(
                f"pairs must have leading dims batch + (n, m) = {batch + shape}, each "
                f"either that size or 1 (broadcast); got {ps}"
            )
        pair_batch.append(ps[:nb])
    col_batch = tuple(tuple(np.shape(c)[:nb]) for c in jax.tree.leaves(cols))
    if all(cb == batch for cb in col_batch):
        col_batch = ()  # nothing broadcasts: no leaf is squeezed
    flat = [jax.tree.flatten(t) for t in (rows, cols, pairs, consts)]
    spec = _TileSpec(
        tile_fn,
        reduce,
        tiles,
        tuple(tree for _, tree in flat),
        batch,
        tuple(pair_batch),
        col_batch,
        upcast,
        vary_consts,
        live,
        forward_mode_error,
    )
    leaves = [
        guard_forward_mode([jnp.asarray(a) for a in lv], forward_mode_error) for lv, _ in flat
    ]
    if ring is None:
        return _tiled_core(spec, *leaves)
    if leaves[2]:
        raise ValueError(
            "pairs (masks, biases) are not supported with a ring; replicate the columns instead"
        )
    if col_batch:
        raise ValueError(
            "columns that broadcast over batch dims are not supported with a ring; "
            "give every column leaf the full batch dims"
        )
    return _ring_core(_ring_spec(spec), ring, *leaves)
