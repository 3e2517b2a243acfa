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

Memory in both directions: inputs + outputs + one tile. The forward and backward tiles
are explicit in the :class:`~memwise.tiling.Tiling` the caller resolves. Tiles that
cannot hold a finite score (above a causal diagonal) are skipped by a ``lax.cond`` in
the one loop body. Used by :func:`memwise.pairwise_reduce` (and so :mod:`memwise.ot`)
and :func:`memwise.attention`.

Not optimal yet: forward mode (``jax.jvp``) is not supported (a ``custom_vjp``);
second derivatives work, but their memory is not bounded by a tile.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from memwise._vjp import Static, add, cotangents, dense, fill, is_zero, select, unwrap
from memwise.sharding import psum_replicated, typed_zeros, vary, varying_over
from memwise.tiling import Chunking, Tiling, leading_length

__all__ = ["REDUCTIONS", "tiled_reduce"]

REDUCTIONS = ("sum", "logsumexp", "max", "softmax")


@dataclasses.dataclass(frozen=True, eq=False)
class _TileSpec:
    """Static description of one tiled reduction (a nondiff argument of the custom_vjp).

    ``tile_fn(rows, cols, pairs, consts, row_ids, col_ids)`` returns the scores of one
    tile, shape ``(R, C) + trailing``; for ``"softmax"`` it returns ``(scores (R, C),
    values (C, dv))`` and the reduction is ``sum_j softmax_j(scores) values_j``.
    Scores equal to -inf are excluded (masking).
    """

    tile_fn: Callable
    reduce: str
    tiles: Tiling
    trees: tuple  # treedefs of (rows, cols, pairs, consts)
    vary_consts: bool = True  # see memwise.sharding.convert
    # live(row_ids, col_ids, consts) -> bool scalar: False when every score of the tile is
    # -inf (e.g. above a causal diagonal); such tiles are skipped with lax.cond.
    live: Callable | None = None

    def tile(self, leaves: Sequence[list], row_ids, col_ids):
        rows, cols, pairs, consts = (
            jax.tree.unflatten(t, l) for t, l in zip(self.trees, leaves)
        )
        return self.tile_fn(rows, cols, pairs, consts, row_ids, col_ids)

    def is_live(self, row_ids, col_ids, const_leaves) -> jax.Array:
        return self.live(row_ids, col_ids, jax.tree.unflatten(self.trees[3], const_leaves))


def _expand(a: jax.Array, ndim: int) -> jax.Array:
    """Append singleton axes so a per-row ``(R,)`` array broadcasts against ``ndim`` dims."""
    return a.reshape(a.shape + (1,) * (ndim - a.ndim))


def _pair_blocks(rows: Chunking, cols: Chunking, pairs: list, i_start, j_start) -> list:
    """The tile of each ``(n, m, ...)`` pair operand at ``(i_start, j_start)``, no copy."""
    return [cols.block(rows.block(p, i_start, axis=0), j_start, axis=1) for p in pairs]


def _safe_max(m: jax.Array) -> jax.Array:
    return jnp.where(jnp.isfinite(m), m, 0.0)


def _row_pass(spec: _TileSpec, rows, cols_c, col_ids, col_valid, pairs, consts, row_ids):
    """Reduce one row block over all column tiles (the forward pass of one row block)."""
    reduce = spec.reduce

    def scores_of(col_blk, c_ids):
        pblk = _pair_blocks(spec.tiles.rows, spec.tiles.cols, pairs, row_ids[0], c_ids[0])
        return spec.tile((rows, col_blk, pblk, consts), row_ids, c_ids)

    first = jax.eval_shape(scores_of, [a[0] for a in cols_c], col_ids[0])
    if reduce == "softmax":
        s_shape, v_shape = first
        dtype = jnp.result_type(s_shape.dtype, v_shape.dtype)
        R = s_shape.shape[0]
        init = (
            jnp.full((R,), -jnp.inf, dtype),
            jnp.zeros((R,), dtype),
            jnp.zeros((R,) + v_shape.shape[1:], dtype),
        )
    else:
        R, trailing, dtype = first.shape[0], first.shape[2:], first.dtype
        if reduce == "sum":
            init = jnp.zeros((R,) + trailing, dtype)
        elif reduce == "logsumexp":
            init = (jnp.full((R,) + trailing, -jnp.inf, dtype), jnp.zeros((R,) + trailing, dtype))
        else:  # max
            init = (
                jnp.full((R,) + trailing, -jnp.inf, dtype),
                jnp.zeros((R,) + trailing, jnp.int32),
            )

    init = vary(init, varying_over(rows, cols_c, pairs, consts))

    def body(state, inp):
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
            s, vals = out
            s = jnp.where(c_valid[None, :], s, -jnp.inf)
            m, l, acc = state
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            shift = _safe_max(m_new)
            p = jnp.exp(s - shift[:, None])
            scale = jnp.exp(m - shift)
            l = l * scale + jnp.sum(p, axis=1)
            acc = acc * _expand(scale, acc.ndim) + jnp.tensordot(p, vals.astype(p.dtype), 1)
            return (m_new, l, acc)
        s = out
        valid = _expand(c_valid[None, :], s.ndim)
        if reduce == "sum":
            return state + jnp.sum(jnp.where(valid, s, 0), axis=1)
        if reduce == "logsumexp":
            m, l = state
            s = jnp.where(valid, s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            shift = _safe_max(m_new)
            l = l * jnp.exp(m - shift) + jnp.sum(jnp.exp(s - shift[:, None]), axis=1)
            return (m_new, l)
        m, arg = state
        s = jnp.where(valid, s, -jnp.inf)
        tile_arg = jnp.argmax(s, axis=1)
        tile_max = jnp.max(s, axis=1)
        better = tile_max > m
        arg = jnp.where(better, c_ids[tile_arg].astype(jnp.int32), arg)
        return (jnp.maximum(m, tile_max), arg)

    state, _ = lax.scan(body, init, (cols_c, col_ids, col_valid))
    if reduce == "sum":
        return state
    if reduce == "logsumexp":
        m, l = state
        return _safe_max(m) + jnp.log(l)
    if reduce == "max":
        return state
    m, l, acc = state
    lse = _safe_max(m) + jnp.log(l)
    out = acc / _expand(jnp.where(l > 0, l, 1.0), acc.ndim)
    return out, lse


def _tiled_forward(spec: _TileSpec, rows, cols, pairs, consts):
    R, C = spec.tiles.rows, spec.tiles.cols
    rows_c = R.split(rows)
    cols_c = C.split(cols)
    col_ids = jnp.asarray(C.ids())
    col_valid = jnp.asarray(C.mask())

    def one_row_block(inp):
        row_blk, r_ids = inp
        return _row_pass(spec, row_blk, cols_c, col_ids, col_valid, pairs, consts, r_ids)

    out = lax.map(one_row_block, (rows_c, jnp.asarray(R.ids())))
    return R.merge(out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tiled_core(spec: _TileSpec, rows, cols, pairs, consts):
    return _tiled_forward(spec, rows, cols, pairs, consts)


def _tiled_core_fwd(spec, *primals):
    values, flags = zip(*(unwrap(p) for p in primals))
    out = _tiled_forward(spec, *values)
    saved = out if spec.reduce != "sum" else None
    return out, (values, saved, Static(flags))


def _tiled_core_bwd(spec, res, ct):
    values, saved, flags = res
    flags = flags.value
    rows, cols, pairs, consts = values
    R, C = spec.tiles.backward_rows, spec.tiles.backward_cols
    reduce = spec.reduce

    # Per-row quantities the backward needs: the cotangent and the saved result.
    if reduce == "softmax":
        out, lse = saved
        ct_out = dense(ct[0], out)
        ct_lse = dense(ct[1], lse)
        delta = jnp.sum((ct_out * out).reshape(out.shape[0], -1), axis=1)
        per_row = [ct_out, ct_lse - delta, lse]
    else:
        value_ct = ct[0] if reduce == "max" else ct
        if is_zero(value_ct):  # zeros of the result's own dtype (int for an int sum)
            like = jax.eval_shape(lambda: _tiled_forward(spec, *values))
            value_ct = dense(value_ct, like[0] if reduce == "max" else like)
        per_row = [value_ct]
        if reduce == "logsumexp":
            per_row.append(saved)
        elif reduce == "max":
            per_row.append(saved[1])  # the argmax

    row_f, col_f, pair_f, const_f = flags
    axes = varying_over(values, per_row)
    primals = values
    # Replicated inputs enter the loops as varying copies so that each tile's vjp yields
    # a local partial cotangent; psum_replicated all-reduces once at the end.
    rows, cols, pairs = vary(values[:3], axes)
    consts = vary(values[3], axes) if spec.vary_consts else values[3]
    per_row_c = R.split(per_row, pad="zero")
    rows_c = R.split(rows)
    cols_c = C.split(cols)
    row_ids, col_ids = jnp.asarray(R.ids()), jnp.asarray(C.ids())
    col_valid = jnp.asarray(C.mask())
    d_consts0 = typed_zeros(select(consts, const_f))
    d_cols0 = typed_zeros(select(cols_c, col_f))
    pad_pairs = [
        vary(jnp.zeros((R.padded, C.padded) + jnp.shape(p)[2:], jnp.result_type(p)), axes)
        for p in select(pairs, pair_f)
    ]

    def row_body(carry, inp):
        d_cols, d_pairs, d_consts = carry
        row_blk, r_ids, row_data = inp

        def col_body(carry2, inp2):
            d_row, d_cols, d_pairs, d_consts = carry2
            col_blk, c_ids, c_valid, j = inp2
            pblk = _pair_blocks(R, C, pairs, r_ids[0], c_ids[0])

            def f(r_d, c_d, p_d, k_d):
                return spec.tile(
                    (
                        fill(row_blk, row_f, r_d),
                        fill(col_blk, col_f, c_d),
                        fill(pblk, pair_f, p_d),
                        fill(consts, const_f, k_d),
                    ),
                    r_ids,
                    c_ids,
                )

            primal_in = (
                select(row_blk, row_f),
                select(col_blk, col_f),
                select(pblk, pair_f),
                select(consts, const_f),
            )
            def tile_grads():
                out, vjp = jax.vjp(f, *primal_in)
                return vjp(_score_cotangent(reduce, out, row_data, c_valid, c_ids))

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
            d_cols = [acc.at[j].add(g.astype(acc.dtype)) for acc, g in zip(d_cols, dc)]
            d_pairs = [_add_block(acc, g, r_ids[0], c_ids[0]) for acc, g in zip(d_pairs, dp)]
            return (d_row, d_cols, d_pairs, add(d_consts, dk)), None

        d_row0 = typed_zeros(select(row_blk, row_f))
        (d_row, d_cols, d_pairs, d_consts), _ = lax.scan(
            col_body,
            (d_row0, d_cols, d_pairs, d_consts),
            (cols_c, col_ids, col_valid, jnp.arange(C.n_chunks)),
        )
        return (d_cols, d_pairs, d_consts), d_row

    (d_cols, d_pairs, d_consts), d_rows = lax.scan(
        row_body, (d_cols0, pad_pairs, d_consts0), (rows_c, row_ids, per_row_c)
    )
    d_rows = psum_replicated(R.merge(d_rows), select(primals[0], row_f))
    d_cols = psum_replicated(C.merge(d_cols), select(primals[1], col_f))
    d_pairs = psum_replicated(
        [a[: R.length, : C.length] for a in d_pairs], select(primals[2], pair_f)
    )
    d_consts = psum_replicated(d_consts, select(primals[3], const_f))
    return (
        cotangents(row_f, d_rows),
        cotangents(col_f, d_cols),
        cotangents(pair_f, d_pairs),
        cotangents(const_f, d_consts),
    )


def _add_block(acc, g, i0, j0):
    r, c = g.shape[0], g.shape[1]
    cur = lax.dynamic_slice(acc, (i0, j0) + (0,) * (acc.ndim - 2), (r, c) + acc.shape[2:])
    return lax.dynamic_update_slice(acc, cur + g.astype(acc.dtype), (i0, j0) + (0,) * (acc.ndim - 2))


def _score_cotangent(reduce, out, row_data, c_valid, c_ids):
    """d(result)/d(tile scores) contracted with the per-row cotangent: one tile's worth."""
    if reduce == "softmax":
        s, vals = out
        ct_out, ct_lse_minus_delta, lse = row_data
        valid = c_valid[None, :] & jnp.isfinite(lse)[:, None]
        p = jnp.where(valid, jnp.exp(s - _safe_max(lse)[:, None]), 0.0)
        ct2 = ct_out.reshape(ct_out.shape[0], -1).astype(p.dtype)
        v2 = vals.reshape(vals.shape[0], -1).astype(p.dtype)
        dp = ct2 @ v2.T
        ds = p * (dp + ct_lse_minus_delta[:, None])
        d_vals = (p.T @ ct2).reshape(vals.shape).astype(vals.dtype)
        return ds.astype(s.dtype), d_vals
    s = out
    ct_row = row_data[0]
    valid = _expand(c_valid[None, :], s.ndim)
    ct_b = jnp.expand_dims(ct_row, 1).astype(s.dtype)
    if reduce == "sum":
        return jnp.where(valid, jnp.broadcast_to(ct_b, s.shape), 0)
    if reduce == "logsumexp":
        lse = jnp.expand_dims(row_data[1], 1)
        live = valid & jnp.isfinite(lse)
        return jnp.where(live, ct_b * jnp.exp(s - _safe_max(lse)), 0)
    arg = jnp.expand_dims(row_data[1], 1)
    hit = _expand(c_ids[None, :], s.ndim) == arg
    return jnp.where(valid & hit, jnp.broadcast_to(ct_b, s.shape), 0)


_tiled_core.defvjp(_tiled_core_fwd, _tiled_core_bwd, symbolic_zeros=True)


def tiled_reduce(
    tile_fn: Callable,
    rows: Any,
    cols: Any,
    *,
    reduce: str,
    tiles: Tiling,
    pairs: Any = (),
    consts: Any = (),
    vary_consts: bool = True,
    live: Callable | None = None,
) -> Any:
    """The engine: reduce tile scores over columns, for every row, tile by tile.

    ``tile_fn(rows_blk, cols_blk, pairs_blk, consts, row_ids, col_ids)`` returns the
    scores of one ``(R, C)`` tile (trailing dims allowed; ``-inf`` = excluded), or for
    ``reduce="softmax"`` a pair ``(scores (R, C), values (C, ...))``. ``rows`` and
    ``cols`` are pytrees with leading lengths n and m; ``pairs`` have leading ``(n, m)``
    and are sliced tile by tile without a padded copy; ``consts`` are passed whole.
    Gradients flow to all four (``tile_fn`` must not close over traced arrays; pass them
    in ``consts``). Results: ``"sum"``/``"logsumexp"``: ``(n,) + trailing``; ``"max"``:
    ``(values, argmax)``; ``"softmax"``: ``(out (n, ...), lse (n,))``.

    ``tiles`` is the resolved :class:`~memwise.tiling.Tiling` (from
    :func:`~memwise.tiling.tiling`): the forward pass runs its ``rows x cols`` tiles,
    the backward pass its ``backward_rows x backward_cols`` tiles.

    Inside ``shard_map``, pass ``vary_consts=False`` when ``tile_fn`` evaluates a jaxpr
    traced with replicated ``consts`` (e.g. from ``jax.closure_convert``).

    ``live(row_ids, col_ids, consts) -> bool scalar`` (optional) marks tiles that can
    hold a finite score; the others are skipped (``lax.cond`` in the one loop body,
    forward and backward). It must depend on the indices and ``consts`` only: a causal
    mask halves the work this way.
    """
    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce must be one of {REDUCTIONS}, got {reduce!r}")
    if not isinstance(tiles, Tiling):
        raise TypeError(f"tiles must be a memwise.tiling.Tiling (from tiling()), got {tiles!r}")
    shape = (leading_length(rows, "rows"), leading_length(cols, "cols"))
    if tiles.shape != shape:
        raise ValueError(f"tiles were resolved for {tiles.shape}, but rows x cols is {shape}")
    flat = [jax.tree.flatten(t) for t in (rows, cols, pairs, consts)]
    spec = _TileSpec(tile_fn, reduce, tiles, tuple(tree for _, tree in flat), vary_consts, live)
    leaves = [[jnp.asarray(a) for a in lv] for lv, _ in flat]
    return _tiled_core(spec, *leaves)
