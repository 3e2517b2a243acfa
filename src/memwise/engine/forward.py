"""The engine's forward pass: every row block reduced over the column tiles.

Each problem of a batch is one call of :func:`statistics` under ``vmap`` (pairs
broadcast over the batch dims they lack, never expanded); within it, row blocks are
sliced by index and their statistics written in place into one carried buffer, and
each row block's pass over the column tiles is a ``lax.scan`` whose step is the
reduction's :meth:`~memwise.engine.reductions.Reduction.update`; with a ``live``
predicate, a loop over the live column blocks alone
(:meth:`~memwise.engine.tiles.TileSpec.over_live`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from memwise.engine.tiles import Leaves, TileSpec, made_after, pair_blocks, store_order
from memwise.sharding import vary, varying_over

__all__ = ["statistics", "tiled_forward"]


def _tile_type(spec: TileSpec, rows: Leaves, cols: Leaves, pairs: Leaves, consts: Leaves) -> Any:
    """Shapes and dtypes of one tile's output (the first tile of the first problem)."""
    R, C, nb = spec.tiles.rows, spec.tiles.cols, len(spec.batch)

    def first_tile():
        r = spec.lay_out_rows([R.block(a[(0,) * nb], 0) for a in rows])
        c = [
            C.block(a[(0,) * k], 0, axis=ax)
            for a, k, ax in zip(cols, spec.col_batch_dims(), spec.item_col_axis())
        ]
        lead = [sum(s != 1 for s in pb) for pb in spec.pair_batch]
        p = pair_blocks(R, C, [a[(0,) * k] for a, k in zip(pairs, lead)], 0, 0)
        return spec.tile((r, c, p, consts), R.chunk_ids(0)[0], C.chunk_ids(0)[0])

    return jax.eval_shape(first_tile)


def _row_pass(
    spec: TileSpec,
    first: Any,
    rows: Any,
    cols: Any,
    pairs: Leaves,
    consts: Leaves,
    row_ids: jax.Array,
) -> Any:
    """Reduce one row block over all column tiles (the forward pass of one row block).

    ``first`` is the tile's output type. Returns the block's statistics (the
    reduction's :meth:`~memwise.engine.reductions.Reduction.close` of its state).
    """
    reduction = spec.reduction

    visits = spec.visits(spec.tiles.cols, row_ids)

    def scores_of(col_blk, c_ids):
        pblk = pair_blocks(spec.tiles.rows, visits, pairs, row_ids[0], c_ids[0])
        return spec.tile((rows, col_blk, pblk, consts), row_ids, c_ids)

    init = vary(reduction.init(first), varying_over(rows, cols, pairs, consts))

    def step(state, k):
        # Column blocks sliced by index from the unsplit columns: splitting them into
        # (chunks, size, ...) made a copy (under vmap, a transposed one) of k and v.
        c_ids, c_valid = visits.chunk_ids(k)
        col_blk = [visits.block(a, c_ids[0], axis=ax) for a, ax in zip(cols, spec.item_col_axis())]
        return reduction.update(state, scores_of(col_blk, c_ids), c_valid, c_ids)

    return reduction.close(spec.over_live(step, init, visits, row_ids, consts))


def _problem_forward(
    spec: TileSpec, first: Any, rows: Any, cols: Any, pairs: Leaves, consts: Leaves
) -> Any:
    """The forward statistics of one problem (no batch dims)."""
    R = spec.tiles.rows

    # Row blocks sliced by index, as the columns' and the backward's: splitting rows
    # into (chunks, size, ...) copied q (transposed, under the batch's vmap).
    def one_row_block(k):
        row_blk = spec.lay_out_rows([R.block(a, k * R.size) for a in rows])
        return _row_pass(spec, first, row_blk, cols, pairs, consts, R.chunk_ids(k)[0])

    # Each block's statistics written in place into a carried buffer: stacking them as
    # the loop's output and merging made two more copies (under vmap, transposed).
    block_type = jax.eval_shape(one_row_block, jnp.int32(0))
    init = jax.tree.map(lambda t: jnp.zeros((R.padded,) + t.shape[1:], t.dtype), block_type)
    init = made_after(vary(init, varying_over(rows, cols, pairs, consts)), rows, cols, pairs)

    def body(acc, k):
        blk = one_row_block(k)
        start = R.start(k * R.size)
        return jax.tree.map(
            lambda a, b: lax.dynamic_update_slice_in_dim(a, b, start, axis=0), acc, blk
        ), None

    # Last block first: a slid-back last block's repeated rows are then overwritten by
    # the block that owns them (store_order), so every row's statistics are its own.
    out, _ = lax.scan(body, init, store_order(R))
    return jax.tree.map(lambda a: a[: R.length], out)


def statistics(
    spec: TileSpec, rows: Leaves, cols: Leaves, pairs: Leaves, consts: Leaves
) -> tuple[Any, Any]:
    """``(tile type, statistics)`` of the whole batch: each problem vmapped, pairs
    broadcast over the batch dims they lack (never expanded)."""
    pairs = spec.squeeze_pairs(pairs)
    cols = spec.squeeze_cols(cols)
    first = _tile_type(spec, rows, cols, pairs, consts)
    problem = spec.over_batch(
        lambda r, c, p: _problem_forward(spec, first, r, c, p, consts),
        lambda level: (0, spec.col_axes(level), spec.pair_axes(level)),
        squeeze_units=False,
    )
    return first, problem(rows, cols, pairs)


def tiled_forward(
    spec: TileSpec, rows: Leaves, cols: Leaves, pairs: Leaves, consts: Leaves
) -> tuple[Any, Any]:
    """``(result, residual)`` of the whole batch."""
    first, stats = statistics(spec, rows, cols, pairs, consts)
    return spec.reduction.finish(first, stats)
