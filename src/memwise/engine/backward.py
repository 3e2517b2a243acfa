"""The engine's backward pass: one more tiled pass that re-evaluates each tile under
``jax.vjp``.

The gradient of a reduction is a reduction of the same shape (KeOps: Charlier, Feydy,
Glaunes, Collin, Durif, JMLR 22, 2021): for every tile, the reduction's score cotangent
(:meth:`~memwise.engine.reductions.Reduction.score_cotangent`, from the per-row
cotangent and the forward's saved statistics) is pulled back through ``tile_fn``.
Cotangents of rows are complete after their row block's pass over the columns and
stored once in their own dtype; those of columns, pairs and constants accumulate over
row blocks, in at least float32, written in place into carries the size of their
operands. ``backward="split"`` adds a column-major pass for the latter, so a column
block's cotangent is complete after its pass over the rows and is stored once in its
own dtype too (a bfloat16 output layer gets no float32 copy of its size). Replicated
inputs enter the loops as varying copies, so each tile's vjp yields a local partial
cotangent that one all-reduce sums at the end. The two loop orders
(``_Loops.rows_first``, ``_Loops.cols_first``) share what they read and the per-tile
step (``_Loops.tile_vjp``) in one object, ``_Loops``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from memwise._dtypes import accumulation_dtype, promote
from memwise._vjp import add, cotangents, fill, select
from memwise.engine.forward import tiled_forward
from memwise.engine.tiles import (
    accumulators,
    made_after,
    pair_blocks,
    store_block,
    store_order,
)
from memwise.sharding import psum_replicated, vary, varying_over

__all__ = ["add_block", "backward", "last_read", "row_data"]


def row_data(spec, values, residual, ct):
    """The per-row quantities the backward needs: the rows' cotangent and the forward's
    saved statistics, as the reduction reads them (attention's ``ct_lse - delta``)."""
    return spec.reduction.row_cotangents(
        residual,
        ct,
        len(spec.batch),
        lambda: jax.eval_shape(lambda: tiled_forward(spec, *values)[0]),
    )


def last_read(per_row):
    """The smallest float per-row arrays (attention's ``ct_lse - delta`` and ``lse``; a
    log-sum-exp's cotangent and ``lse``): what the backward's zero accumulators are
    made after (:func:`~memwise.engine.tiles.made_after`). Not after the result-sized
    ones: a zero that reads the result keeps it alive until the accumulator is made, so
    XLA cannot reuse the result's buffer for it (grouped-query attention's gradient
    held a second query-sized buffer: 65 -> 40 MiB at T = 16,384 on one device, and
    32.8 -> 21.4 MiB a device on a ring of 8 at T = 65,536)."""
    floats = [a for a in per_row if jnp.issubdtype(a.dtype, jnp.inexact)] or per_row
    smallest = min(a.size for a in floats)
    return [a for a in floats if a.size == smallest]


def backward(spec, values, residual, flags, ct, running=None):
    """The tiled backward pass: the cotangents of ``values`` (``None`` where a flag is
    off). With ``running`` (a ring's accumulators, see :func:`_ring_core_bwd`), this
    pass adds into them instead and returns them in the accumulation dtype: the rows'
    at the rows' shape, the columns' padded to whole tiles (pairs: ``None`` gives this
    pass's own, returned padded, squeezed as
    :meth:`~memwise.engine.tiles.TileSpec.squeeze_pairs` squeezes them)."""
    loops = _Loops(spec, values, row_data(spec, values, residual, ct))
    if running is not None:
        d_rows, d_cols, d_pairs, d_consts = running
        if d_pairs is None:  # a ring's pair cotangents: this block's, fresh
            d_pairs = loops.zeros(flags, "rows")[2]
        return loops.rows_first(flags, (d_rows, d_cols, d_pairs, d_consts), ring=True)
    if spec.backward == "rows":
        return loops.finish(flags, loops.rows_first(flags, loops.zeros(flags, "rows")))
    return loops.finish(flags, loops.split(flags))


class _Loops:
    """What the backward's loop orders share: the operands as the tiles read them (made
    varying, squeezed), the per-row data, the zero accumulators, one tile's vjp (the
    per-tile step) and the row and column blocks it is given.

    Blocks are sliced by index from the unpadded arrays (splitting into (chunks, size,
    ...) copied q once more), and cotangents are written in place into carries of the
    operands' own shapes (store_block puts a ragged last block where it came from); a
    pair's carry is padded, its slots past the end masked, then sliced off.
    """

    def __init__(self, spec, values, per_row):
        self.spec, self.primals, self.per_row = spec, values, per_row
        self.R, self.C = spec.tiles.backward_rows, spec.tiles.backward_cols
        self.nb = len(spec.batch)
        self.axes = varying_over(values, per_row)
        # Replicated inputs enter the loops as varying copies so that each tile's vjp
        # yields a local partial cotangent; psum_replicated all-reduces once at the end.
        rows, cols, pairs = vary(values[:3], self.axes)
        consts = vary(values[3], self.axes) if spec.vary_consts else values[3]
        self.rows = rows
        self.consts = promote(consts) if spec.upcast else consts
        self.pairs = spec.squeeze_pairs(pairs)
        self.cols = spec.squeeze_cols(cols)
        # A pair's row/column axes follow the batch dims it does not broadcast over; so
        # does a column leaf's column axis.
        self.lead = [sum(s != 1 for s in pb) for pb in spec.pair_batch]
        self.col_lead = spec.col_lead()

    def pair_accumulator(self, p, k):
        """A pair's zero carry, padded to whole tiles on its row and column axes."""
        R, C = self.R, self.C
        shape = list(p.shape)
        full_rows, full_cols = shape[k] == R.length, shape[k + 1] == C.length
        shape[k] = R.padded if full_rows else 1
        shape[k + 1] = C.padded if full_cols else 1
        # A full pair gets each element once; one broadcast over rows or columns sums
        # one contribution per tile, in the accumulation dtype.
        once = (full_rows or R.length == 1) and (full_cols or C.length == 1)
        dtype = jnp.result_type(p) if once else accumulation_dtype(jnp.result_type(p))
        return vary(jnp.zeros(shape, dtype), self.axes)

    def zeros(self, fl, own):
        """The zero accumulators of the cotangents selected by ``fl`` (rows and columns
        at their operands' shapes, pairs padded): the rows' (``own="rows"``) or the
        columns' (``"cols"``) in their own dtype, each block stored once; the others in
        at least float32, summed over blocks."""
        row_f, col_f, pair_f, const_f = fl

        def acc(a, mine):  # unpadded: blocks are stored (or added) by store_block
            dtype = a.dtype if own == mine else accumulation_dtype(a.dtype)
            return vary(jnp.zeros(a.shape, dtype), self.axes)

        d_rows0 = [acc(a, "rows") for a in select(self.rows, row_f)]
        d_cols0 = [acc(a, "cols") for a in select(self.cols, col_f)]
        d_pairs0 = [
            self.pair_accumulator(p, k)
            for p, k in zip(select(self.pairs, pair_f), select(self.lead, pair_f))
        ]
        d_consts0 = accumulators(select(self.consts, const_f))
        d_rows0, d_cols0, d_pairs0 = made_after(
            (d_rows0, d_cols0, d_pairs0), last_read(self.per_row)
        )
        return d_rows0, d_cols0, d_pairs0, d_consts0

    def tile_vjp(self, fl, r_ids, c_ids, operands):
        """The cotangents of one tile's inputs selected by ``fl`` (the four flags).
        ``operands`` is ``(row block, per-row data, row validity, column block, pair
        block, column validity)``. Only live tiles get here (``TileSpec.over_live``)."""
        spec, consts = self.spec, self.consts
        row_blk, per_row_blk, r_valid, col_blk, pblk, c_valid = operands
        blocks = [row_blk, col_blk, pblk]
        if spec.upcast:
            blocks = promote(blocks)
        primals = tuple(select(b, f_) for b, f_ in zip((*blocks, consts), fl))
        # One tile of every problem in the batch at once.
        tile = spec.over_batch(
            lambda r, c, p, k: spec.tile((r, c, p, k), r_ids, c_ids),
            lambda level: (0, spec.col_axes(level), spec.pair_axes(level), None),
        )

        def f(r_d, c_d, p_d, k_d):
            return tile(
                fill(blocks[0], fl[0], r_d),
                fill(blocks[1], fl[1], c_d),
                fill(blocks[2], fl[2], p_d),
                fill(consts, fl[3], k_d),
            )

        score_ct = spec.over_batch(
            lambda out, rd: spec.reduction.score_cotangent(out, rd, r_valid, c_valid, c_ids),
            lambda level: (0, 0),
        )
        out, vjp = jax.vjp(f, *primals)
        return vjp(score_ct(out, per_row_blk))

    def row_side(self, k, rows_of):
        """Row block ``k`` of ``rows_of``: its ids, validity, start, the block as sliced
        (its own layout), as the tile reads it, and its per-row data."""
        nb = self.nb
        r_ids, r_valid = rows_of.chunk_ids(k)
        r0 = r_ids[0]
        block = [rows_of.block(a, r0, axis=nb) for a in self.rows]
        laid_out = self.spec.lay_out_rows(block, batched=True)
        per_row_blk = [rows_of.block(a, r0, axis=nb) for a in self.per_row]
        return r_ids, r_valid, r0, block, laid_out, per_row_blk

    def col_side(self, k, cols_of):
        """Column block ``k`` of ``cols_of``: its ids, validity, start and the block."""
        c_ids, c_valid = cols_of.chunk_ids(k)
        c0 = c_ids[0]
        blocks = [cols_of.block(a, c0, axis=ax) for a, ax in zip(self.cols, self.col_lead)]
        return c_ids, c_valid, c0, blocks

    def rows_back(self, block, d_row, fl):
        """A laid-out row block's cotangent in the block's own layout."""
        spec = self.spec
        if spec.row_layout is None:
            return d_row
        # (at the accumulators' dtypes: the layout is linear)
        primal = [a.astype(g.dtype) for a, g in zip(select(block, fl[0]), d_row)]
        _, pull = jax.vjp(
            lambda *xs: select(spec.lay_out_rows(fill(block, fl[0], xs), batched=True), fl[0]),
            *primal,
        )
        return list(pull(d_row))

    def add_pairs(self, d_pairs, dp, r0, c0, pair_f):
        """A tile's pair cotangents added into the pairs' carries."""
        return [
            add_block(acc, g, (r0, c0), k)
            for acc, g, k in zip(d_pairs, dp, select(self.lead, pair_f))
        ]

    def rows_first(self, fl, init, ring=False):
        """Row blocks outer: a row block's cotangent is complete after its column tiles.
        On a ``ring``, one column block's pass: the rows' cotangents add to the other
        blocks' share."""
        spec, R, C, nb = self.spec, self.R, self.C, self.nb
        row_f, col_f, pair_f, _ = fl

        def row_body(carry, inp):
            d_rows, d_cols, d_pairs, d_consts = carry
            r_ids, r_valid, r0, block, row_blk, per_row_blk = self.row_side(inp, R)
            visits = spec.visits(C, r_ids)

            def col_body(carry2, inp2):
                d_row, d_cols, d_pairs, d_consts = carry2
                c_ids, c_valid, c0, col_blk = self.col_side(inp2, visits)
                pblk = pair_blocks(R, visits, self.pairs, r0, c0, self.lead)
                operands = (row_blk, per_row_blk, r_valid, col_blk, pblk, c_valid)
                dr, dc, dp, dk = self.tile_vjp(fl, r_ids, c_ids, operands)
                d_cols = [
                    store_block(acc, g, visits, c0, k, add=True)
                    for acc, g, k in zip(d_cols, dc, select(self.col_lead, col_f))
                ]
                d_pairs = self.add_pairs(d_pairs, dp, r0, c0, pair_f)
                return add(d_row, dr), d_cols, d_pairs, add(d_consts, dk)

            d_row, d_cols, d_pairs, d_consts = spec.over_live(
                col_body,
                (accumulators(select(row_blk, row_f)), d_cols, d_pairs, d_consts),
                visits,
                r_ids,
                self.consts,
            )
            d_row = self.rows_back(block, d_row, fl)
            # Off a ring a row block's cotangent is complete here: stored once, in its own
            # dtype; on a ring, added to the other column blocks' share.
            d_rows = [store_block(acc, g, R, r0, nb, add=ring) for acc, g in zip(d_rows, d_row)]
            return (d_rows, d_cols, d_pairs, d_consts), None

        # (the ring adds into its rows: any order)
        return lax.scan(row_body, init, R.indices() if ring else store_order(R))[0]

    def cols_first(self, fl, init):
        """Column blocks outer: a column block's cotangent is complete after its row
        tiles, stored once in its own dtype (the rows' are summed in float32)."""
        spec, R, C, nb = self.spec, self.R, self.C, self.nb
        _, col_f, pair_f, _ = fl

        def col_body(carry, inp):
            d_rows, d_cols, d_pairs, d_consts = carry
            c_ids, c_valid, c0, col_blk = self.col_side(inp, C)
            visits = spec.visits(R, c_ids, over="rows")

            def row_body(carry2, inp2):
                d_rows, d_col, d_pairs, d_consts = carry2
                r_ids, r_valid, r0, block, row_blk, per_row_blk = self.row_side(inp2, visits)
                pblk = pair_blocks(visits, C, self.pairs, r0, c0, self.lead)
                operands = (row_blk, per_row_blk, r_valid, col_blk, pblk, c_valid)
                dr, dc, dp, dk = self.tile_vjp(fl, r_ids, c_ids, operands)
                dr = self.rows_back(block, dr, fl)
                d_rows = [
                    store_block(acc, g, visits, r0, nb, add=True) for acc, g in zip(d_rows, dr)
                ]
                d_pairs = self.add_pairs(d_pairs, dp, r0, c0, pair_f)
                return d_rows, add(d_col, dc), d_pairs, add(d_consts, dk)

            d_rows, d_col, d_pairs, d_consts = spec.over_live(
                row_body,
                (d_rows, accumulators(select(col_blk, col_f)), d_pairs, d_consts),
                visits,
                c_ids,
                self.consts,
                over="rows",
            )
            d_cols = [
                store_block(acc, g, C, c0, k)
                for acc, g, k in zip(d_cols, d_col, select(self.col_lead, col_f))
            ]
            return (d_rows, d_cols, d_pairs, d_consts), None

        return lax.scan(col_body, init, store_order(C))[0]

    def split(self, flags):
        """``backward="split"``: the rows' cotangents row-major, the others column-major,
        each complete per block and stored once in its own dtype."""
        row_f, col_f, pair_f, const_f = flags
        none = [[False] * len(f_) for f_ in flags]
        row_fl = (row_f, *none[1:])
        col_fl = (none[0], col_f, pair_f, const_f)
        d_rows = self.rows_first(row_fl, self.zeros(row_fl, "rows"))[0] if any(row_f) else []
        if any(col_f) or any(pair_f) or any(const_f):
            _, d_cols, d_pairs, d_consts = self.cols_first(col_fl, self.zeros(col_fl, "cols"))
        else:
            d_cols, d_pairs, d_consts = [], [], []
        return d_rows, d_cols, d_pairs, d_consts

    def finish(self, flags, cts):
        """The accumulators as the primals' cotangents: sliced to the operands' lengths,
        all-reduced where an operand was replicated, in the primals' dtypes and shapes."""
        spec, primals, nb = self.spec, self.primals, self.nb
        row_f, col_f, pair_f, const_f = flags
        d_rows, d_cols, d_pairs, d_consts = cts

        def finish(cts, primal_group):
            return [
                c.astype(p.dtype) for c, p in zip(psum_replicated(cts, primal_group), primal_group)
            ]

        d_rows = finish(
            [lax.slice_in_dim(a, 0, self.R.length, axis=nb) for a in d_rows],
            select(primals[0], row_f),
        )
        primal_cols = select(primals[1], col_f)
        d_cols = [
            lax.slice_in_dim(a, 0, self.C.length, axis=k)
            for a, k in zip(d_cols, select(self.col_lead, col_f))
        ]
        d_cols = [
            d.reshape(p.shape)
            for d, p in zip(
                finish(d_cols, select(spec.squeeze_cols(primals[1]), col_f)), primal_cols
            )
        ]
        d_pairs = [
            lax.slice(a, (0,) * a.ndim, p.shape[:k] + p.shape[k : k + 2] + a.shape[k + 2 :])
            for a, p, k in zip(d_pairs, select(self.pairs, pair_f), select(self.lead, pair_f))
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


def add_block(acc, g, starts, k):
    """Add a block's cotangent ``g`` into ``acc`` at ``starts`` on axes ``k, k+1, ...``
    (at 0 on an axis of size 1: a pair that broadcasts over it)."""
    starts = tuple(i if n != 1 else 0 for i, n in zip(starts, acc.shape[k:]))
    zero = jnp.zeros((), jnp.int32)  # one index dtype (python 0s are int64 under x64)
    start = (zero,) * k + tuple(jnp.asarray(i, jnp.int32) for i in starts)
    start += (zero,) * (acc.ndim - len(start))
    cur = lax.dynamic_slice(acc, start, g.shape)
    return lax.dynamic_update_slice(acc, cur + g.astype(acc.dtype), start)
