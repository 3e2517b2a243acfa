"""The reductions the tile engine computes: one object per kind, every rule of it here.

The engine's loops are generic; what a reduction kind decides is which running state a
row block carries over the column tiles, how one tile updates it, how two partial
results over disjoint columns merge (a ring's blocks, devices holding different
columns), which per-row quantities its backward needs, and the cotangent of one tile's
scores. :data:`REDUCTIONS` maps each kind's name to its object; adding a kind means
one new :class:`Reduction` subclass and one entry there, nothing in the loops.

The results they rely on: the online log-sum-exp and softmax (Milakov & Gimelshein,
arXiv:1805.02867; Rabe & Staats, arXiv:2112.05682) keep a running maximum and rescale
what was summed before it; two partial log-sum-exps merge with ``logaddexp``, two
partial softmax outputs as their ``exp(lse)``-weighted mean; the backward re-forms a
tile's probabilities from the saved log-sum-exp (the FlashAttention backward: Dao, Fu,
Ermon, Rudra, Re, NeurIPS 2022). Statistics are kept in :func:`accumulation_dtype`
(the max: in the scores' own dtype, where it is exact).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from memwise._dtypes import accumulation_dtype, sum_dtype
from memwise._vjp import dense, is_zero

__all__ = ["REDUCTIONS", "Reduction", "expand", "safe_max"]


def safe_max(m: jax.Array) -> jax.Array:
    """``m`` with non-finite entries (a row that saw no finite score) as 0: the shift
    of a stable ``exp``."""
    return jnp.where(jnp.isfinite(m), m, 0.0)


def log_denominator(denom: jax.Array) -> jax.Array:
    """``log denom`` of a shifted sum: ``-inf`` where no score was finite, with a zero
    derivative there (``log 0``'s is ``0 / 0``: a ring block that a row does not see made
    forward-over-reverse NaN through the merge)."""
    seen = (denom > 0) | jnp.isnan(denom)  # a NaN score propagates, as in jnp
    return jnp.where(seen, jnp.log(jnp.where(seen, denom, 1.0)), -jnp.inf)


def closed_lse(m: jax.Array, denom: jax.Array) -> jax.Array:
    """``log sum exp`` from the running max and the shifted sum (``-inf`` where no score
    was finite)."""
    return safe_max(m) + log_denominator(denom)


def merged_lse(a: jax.Array, b: jax.Array) -> jax.Array:
    """``logaddexp(a, b)``, with a zero derivative where both are ``-inf`` (``jnp``'s
    is NaN there: two ring slices in a row that a row does not see made
    forward-over-reverse NaN)."""
    unseen = jnp.isneginf(a) & jnp.isneginf(b)
    merged = jnp.logaddexp(jnp.where(unseen, 0.0, a), jnp.where(unseen, 0.0, b))
    return jnp.where(unseen, -jnp.inf, merged)


def expand(a: jax.Array, ndim: int) -> jax.Array:
    """Append singleton axes so a per-row ``(R,)`` array broadcasts against ``ndim`` dims."""
    return a.reshape(a.shape + (1,) * (ndim - a.ndim))


class Reduction:
    """One reduction kind: the rules the engine's loops apply.

    ``first`` is the type of one tile's output (``jax.eval_shape`` of ``tile_fn``):
    scores ``(R, C) + trailing``, or for ``"softmax"`` ``(scores, values[, weights])``.
    A row block's *state* is what its pass over the column tiles carries; its
    *statistics* what :meth:`close` makes of it; :meth:`finish` turns the statistics of
    every row into ``(result, residual)``, the residual being what the backward reads.
    """

    name: ClassVar[str]

    def init(self, first: Any) -> Any:
        """The state of one row block before any column tile."""
        raise NotImplementedError

    def update(self, state: Any, out: Any, c_valid: jax.Array, c_ids: jax.Array) -> Any:
        """The state after one tile's output ``out`` (``c_valid``: real columns)."""
        raise NotImplementedError

    def close(self, state: Any) -> Any:
        """A row block's statistics from its final state."""
        return state

    def combine(self, a: Any, b: Any) -> Any:
        """The statistics over two disjoint sets of columns (associative)."""
        raise NotImplementedError

    def globalize(self, stats: Any, offset: jax.Array) -> Any:
        """Statistics of a column block whose first global column is ``offset``, with
        any column index they hold made global (a ring's blocks)."""
        return stats

    def localize(self, residual: Any, offset: jax.Array) -> Any:
        """The residual as seen from the column block starting at ``offset``."""
        return residual

    def localize_tile(self, out: Any, offset: jax.Array) -> Any:
        """A tile's output as seen from the column block starting at ``offset``: a
        ring's ``tile_fn`` sees global column ids, the loops and this table the block's."""
        return out

    def finish(self, first: Any, stats: Any) -> tuple[Any, Any]:
        """``(result, residual)``: the result in the scores' dtype; where the dtypes
        agree they are one buffer."""
        raise NotImplementedError

    def row_cotangents(
        self, residual: Any, ct: Any, batch_ndim: int, result: Callable[[], Any]
    ) -> list:
        """The per-row quantities the backward slices with each row block: the result's
        cotangent made dense (``result()`` gives the result's type), and what of the
        residual the score cotangent needs."""
        raise NotImplementedError

    def score_cotangent(
        self,
        out: Any,
        row_data: list,
        r_valid: jax.Array,
        c_valid: jax.Array,
        c_ids: jax.Array,
    ) -> Any:
        """d(result)/d(tile output) contracted with the rows' cotangent: one tile's
        worth, computed in the accumulation dtype and returned in the tile's dtypes.
        Padding rows and columns get exactly zero (their scores may overflow ``exp``)."""
        raise NotImplementedError

    def combine_over_devices(self, local: Any, axes: Any, m_local: int) -> Any:
        """The result over every device's columns, from each device's result over its
        own ``m_local`` columns (inside ``shard_map``, columns split over ``axes``)."""
        raise NotImplementedError

    def empty(self, n: int, shape: tuple, dtype: Any) -> jax.Array | None:
        """The result of ``n`` rows over zero columns (``None``: no identity, as
        ``jnp.max`` of an empty array); ``shape`` is one row's."""
        raise NotImplementedError


class Sum(Reduction):
    """``sum_j s_ij``, in ``jnp.sum``'s dtype (bool and narrow integers widen)."""

    name = "sum"

    def init(self, first):
        acc = accumulation_dtype(sum_dtype(first.dtype))
        return jnp.zeros((first.shape[0],) + first.shape[2:], acc)

    def update(self, state, out, c_valid, c_ids):
        valid = expand(c_valid[None, :], out.ndim)
        return state + jnp.sum(jnp.where(valid, out, 0), axis=1, dtype=state.dtype)

    def combine(self, a, b):
        return a + b

    def finish(self, first, stats):
        return stats.astype(sum_dtype(first.dtype)), None

    def row_cotangents(self, residual, ct, batch_ndim, result):
        return [dense(ct, result()) if is_zero(ct) else ct]

    def score_cotangent(self, out, row_data, r_valid, c_valid, c_ids):
        valid = expand(c_valid[None, :] & r_valid[:, None], out.ndim)
        ct_b = jnp.expand_dims(row_data[0], 1).astype(out.dtype)
        return jnp.where(valid, jnp.broadcast_to(ct_b, out.shape), 0)

    def combine_over_devices(self, local, axes, m_local):
        return lax.psum(local, axes)

    def empty(self, n, shape, dtype):
        return jnp.zeros((n,) + shape, sum_dtype(dtype))


class LogSumExp(Reduction):
    """``log sum_j exp(s_ij)`` (``-inf`` where every score is); the float32 log-sum-exp
    is the residual."""

    name = "logsumexp"

    def init(self, first):
        acc = accumulation_dtype(first.dtype)
        shape = (first.shape[0],) + first.shape[2:]
        return jnp.full(shape, -jnp.inf, acc), jnp.zeros(shape, acc)

    def update(self, state, out, c_valid, c_ids):
        m, denom = state
        s = jnp.where(expand(c_valid[None, :], out.ndim), out, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1).astype(m.dtype))
        shift = safe_max(m_new)
        p = jnp.exp(s.astype(m.dtype) - jnp.expand_dims(shift, 1))
        return m_new, denom * jnp.exp(m - shift) + jnp.sum(p, axis=1)

    def close(self, state):
        m, denom = state
        return closed_lse(m, denom)

    def combine(self, a, b):
        return merged_lse(a, b)

    def finish(self, first, stats):
        return stats.astype(first.dtype), stats

    def row_cotangents(self, residual, ct, batch_ndim, result):
        return [dense(ct, result()) if is_zero(ct) else ct, residual]

    def score_cotangent(self, out, row_data, r_valid, c_valid, c_ids):
        valid = expand(c_valid[None, :] & r_valid[:, None], out.ndim)
        ct_row, lse = row_data[0], jnp.expand_dims(row_data[1], 1)
        live = valid & jnp.isfinite(lse)
        ct_b = jnp.expand_dims(ct_row, 1).astype(lse.dtype)
        w = jnp.exp(out.astype(lse.dtype) - safe_max(lse))
        return jnp.where(live, ct_b * w, 0).astype(out.dtype)

    def combine_over_devices(self, local, axes, m_local):
        top = lax.pmax(lax.stop_gradient(local), axes)
        top = jnp.where(jnp.isfinite(top), top, 0.0)
        return top + jnp.log(lax.psum(jnp.exp(local - top), axes))

    def empty(self, n, shape, dtype):
        if n == 0:
            return jnp.zeros((n,) + shape, dtype)
        return jnp.full((n,) + shape, -jnp.inf, dtype)


class LogSumExpAndPick(LogSumExp):
    """``(log sum_j exp(s_ij), s_ik_i)`` as ``(n, 2)``: the log-sum-exp of the scores and
    the score at one column ``k_i`` per row (a cross-entropy's label), ``-inf`` where
    ``k_i`` is not among the columns (another device's vocabulary).

    The tile's output is ``(scores (R, C), k (R,) int)``. The pick is one gather per row
    and tile, where a second score channel (``s`` at ``k``, ``-inf`` elsewhere) would
    double the exponentials of both passes (measured: the cross-entropy's gradient 1.5x
    faster at 2,048 x 512 x 32,000). The picked score is a log-sum-exp over one column,
    so partial results merge and combine over devices as :class:`LogSumExp`'s, both
    channels in one collective; the float32 log-sum-exp is the residual.
    """

    name = "logsumexp_pick"

    def init(self, first):
        m, denom = super().init(first[0])
        return m, denom, jnp.full(m.shape, -jnp.inf, m.dtype)

    def update(self, state, out, c_valid, c_ids):
        m, denom, picked = state
        s, k = out
        m, denom = super().update((m, denom), s, c_valid, c_ids)
        # Column ids are contiguous within a tile (Chunking.chunk_ids): k's slot is k - c0.
        at = k - c_ids[0]
        inside = (at >= 0) & (at < c_ids.shape[0])
        at = jnp.clip(at, 0, c_ids.shape[0] - 1)
        value = jnp.take_along_axis(s, at[:, None], axis=1)[:, 0].astype(picked.dtype)
        return m, denom, jnp.where(inside & c_valid[at], value, picked)

    def close(self, state):
        m, denom, picked = state
        return jnp.stack([closed_lse(m, denom), picked], axis=-1)

    def localize_tile(self, out, offset):
        s, k = out
        return s, k - offset  # the pick's column in this block's ids

    def finish(self, first, stats):
        return stats.astype(first[0].dtype), stats[..., 0]  # (batch dims lead)

    def score_cotangent(self, out, row_data, r_valid, c_valid, c_ids):
        s, k = out
        ct_row, lse = row_data
        valid = c_valid[None, :] & r_valid[:, None]
        live = valid & jnp.isfinite(lse)[:, None]
        ct_row = ct_row.astype(lse.dtype)
        p = jnp.exp(s.astype(lse.dtype) - safe_max(lse)[:, None])
        hit = valid & (c_ids[None, :] == k[:, None])
        ds = jnp.where(live, ct_row[:, :1] * p, 0) + jnp.where(hit, ct_row[:, 1:], 0)
        return ds.astype(s.dtype), np.zeros(k.shape, jax.dtypes.float0)

    def empty(self, n, shape, dtype):
        return None


class Max(Reduction):
    """``(max_j s_ij, argmax_j s_ij)`` with ``jnp.max``/``jnp.argmax`` semantics: the
    first index wins ties, and the first NaN wins and propagates. Exact in any dtype;
    the argmax (int32) is the residual, the gradient flows to the scores it picks."""

    name = "max"

    def init(self, first):
        shape = (first.shape[0],) + first.shape[2:]
        return jnp.full(shape, -jnp.inf, first.dtype), jnp.zeros(shape, jnp.int32)

    def update(self, state, out, c_valid, c_ids):
        m, arg = state
        s = jnp.where(expand(c_valid[None, :], out.ndim), out, -jnp.inf)
        tile_arg = jnp.argmax(s, axis=1)
        tile_max = jnp.max(s, axis=1)
        better = (tile_max > m) | (jnp.isnan(tile_max) & ~jnp.isnan(m))
        arg = jnp.where(better, c_ids[tile_arg].astype(jnp.int32), arg)
        return jnp.where(better, tile_max, m), arg

    def combine(self, a, b):
        (va, ia), (vb, ib) = a, b
        # The larger value, the first index on ties, and the first NaN wins (blocks
        # arrive in ring order, not column order).
        better = (
            (vb > va) | ((vb == va) & (ib < ia)) | (jnp.isnan(vb) & (~jnp.isnan(va) | (ib < ia)))
        )
        return jnp.where(better, vb, va), jnp.where(better, ib, ia)

    def globalize(self, stats, offset):
        return stats[0], stats[1] + offset

    def localize(self, residual, offset):
        # The global argmax as an index into this block (out of range: another block's).
        return residual - offset

    def finish(self, first, stats):
        return stats, stats[1]

    def row_cotangents(self, residual, ct, batch_ndim, result):
        value_ct = ct[0]
        if is_zero(value_ct):
            value_ct = dense(value_ct, result()[0])
        return [value_ct, residual]

    def score_cotangent(self, out, row_data, r_valid, c_valid, c_ids):
        valid = expand(c_valid[None, :] & r_valid[:, None], out.ndim)
        hit = expand(c_ids[None, :], out.ndim) == jnp.expand_dims(row_data[1], 1)
        ct_b = jnp.expand_dims(row_data[0], 1).astype(out.dtype)
        return jnp.where(valid & hit, jnp.broadcast_to(ct_b, out.shape), 0)

    def combine_over_devices(self, local, axes, m_local):
        """``local`` is ``(value, index or None)``; without an index, only the values
        are gathered (``O(n)`` per device)."""
        value, arg = local
        values = lax.all_gather(value, axes)  # (devices, n, ...)
        if arg is None:
            return jnp.max(values, 0), None
        # Global index: the device's first column plus its local index; the first device
        # wins ties and NaNs, as the first column does within one.
        args = lax.all_gather(arg + lax.axis_index(axes) * m_local, axes)
        best = jnp.argmax(values, 0)
        return jnp.max(values, 0), jnp.take_along_axis(args, best[None], 0)[0]

    def empty(self, n, shape, dtype):
        return jnp.zeros((n,) + shape, dtype) if n == 0 else None


def _letters(first: str, n: int) -> str:
    """``n`` einsum letters from ``first`` on: the head and value dims of a softmax tile."""
    return "".join(chr(ord(first) + i) for i in range(n))


def _grouped(s: jax.Array, vals: jax.Array) -> tuple[Callable, jax.Array, str]:
    """A softmax tile's group of heads sharing the values, merged with the rows.

    The head dims right before the rows that the values are shared over (size 1 in
    ``vals``, not in the scores ``h + (R, C)``; a K/V head serving its group of query
    heads), when those are the only shared ones, become one matmul dim with the rows:
    the tile's products then neither broadcast the values nor sum over the group after.
    Returns ``rows(a)`` (``a`` of ``h + (R,) + rest`` with the group folded into its
    rows), the values without the group's dims, and the einsum letters of the heads
    left. Without such a group: ``a`` and ``vals`` as they are (other shared dims are
    broadcast by the einsums and summed by the values' cotangent).
    """
    nh = s.ndim - 2
    shared = [i for i in range(nh) if vals.shape[i] == 1 and s.shape[i] != 1]
    g = len(shared) if shared == list(range(nh - len(shared), nh)) else 0
    lead = s.shape[: nh - g]
    return (
        lambda a: a.reshape(lead + (-1,) + a.shape[nh + 1 :]),
        vals.reshape(lead + vals.shape[nh:]) if g else vals,
        _letters("a", nh - g),
    )


class Softmax(Reduction):
    """``(sum_j p_ij w_ij v_j, lse_i)`` with ``p`` the softmax of the scores over ``j``
    (attention; value weights ``w``, dropout's ``keep / (1 - rate)``, leave the
    denominator unchanged and get no gradient). The residual is the unrounded output
    and the float32 log-sum-exp as an unevaluated sum ``lse + lse_low``: ``lse`` rounded,
    ``lse_low`` what the rounding lost.

    Why two numbers: a row whose every key a large additive mask hides (a bias of
    ``-1e9``) has scores that all round to the bias, and ``lse = -1e9 + log S`` rounds
    to ``-1e9`` in float32; the backward's ``exp(s - lse)`` then re-formed weights of 1,
    not ``1 / S``, and dq, dk, dv came out ``S`` times too large. So the statistics keep
    the row's maximum and the log of the shifted sum apart (their merges too) until
    :meth:`finish`, and the backward re-forms ``exp((s - lse) - lse_low)``, where
    ``s - lse`` is exact when the two are close (Sterbenz): one more subtraction per
    score, and one more float32 per row in the residual.

    A tile may hold several heads, leading: scores ``h + (R, C)``, values
    ``h' + (C,) + dv`` where each dim of ``h'`` is that of ``h`` or 1 (a K/V head
    serving a group of query heads), weights ``h + (R, C)``; one softmax per head, out
    ``(R,) + h + dv`` and lse ``(R,) + h`` (rows lead in the results, so that a row
    block is written in place). Attention in ``(B, T, N, H)`` layout reads its query
    tiles with every head this way: each tile's products are batched matmuls, and no
    head is moved in front of ``T`` outside a tile.
    """

    name = "softmax"

    @staticmethod
    def _dims(s_ndim: int, v_ndim: int) -> tuple[str, str]:
        """The einsum letters of the head dims and of the value dims."""
        nh = s_ndim - 2
        return _letters("a", nh), _letters("p", v_ndim - 1 - nh)

    def init(self, first):
        s_type, v_type = first[:2]
        acc = accumulation_dtype(s_type.dtype)
        stat = s_type.shape[:-1]  # h + (R,)
        nh = len(stat) - 1
        return (
            jnp.full(stat, -jnp.inf, acc),
            jnp.zeros(stat, acc),
            jnp.zeros(stat + v_type.shape[nh + 1 :], accumulation_dtype(v_type.dtype)),
        )

    def update(self, state, out, c_valid, c_ids):
        m, denom, acc = state
        s, vals = out[:2]
        dv = self._dims(s.ndim, vals.ndim)[1]
        # Widened inside the fused exp/sum only; the tile itself stays as produced.
        s = jnp.where(c_valid, s, -jnp.inf).astype(m.dtype)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        shift = safe_max(m_new)
        p = jnp.exp(s - shift[..., None])
        scale = jnp.exp(m - shift)
        denom = denom * scale + jnp.sum(p, axis=-1)
        # Value weights (dropout) scale the sum of values, not the denominator.
        pw = p if len(out) == 2 else p * out[2].astype(m.dtype)
        rows, shared, hl = _grouped(s, vals.astype(acc.dtype))
        summed = jnp.einsum(f"{hl}rj,{hl}j{dv}->{hl}r{dv}", rows(pw), shared)
        summed = summed.reshape(acc.shape)
        acc = acc * expand(scale, acc.ndim).astype(acc.dtype) + summed
        return m_new, denom, acc

    def close(self, state):
        """``(out, max, log_sum)``: the log-sum-exp is ``max + log_sum``, kept apart (the
        max 0 and the log ``-inf`` where no score was finite)."""
        m, denom, acc = state
        nh = m.ndim - 1
        out = acc / expand(jnp.where(denom > 0, denom, 1.0), acc.ndim)
        # Rows first: heads h + (R,) + dv -> (R,) + h + dv (once per row block).
        return tuple(jnp.moveaxis(a, nh, 0) for a in (out, safe_max(m), log_denominator(denom)))

    def combine(self, a, b):
        (oa, ma, la), (ob, mb, lb) = a, b
        # The larger max of the blocks that saw a score (an unseen block's is a stand-in
        # 0), and each block's log-sum relative to it.
        m = jnp.where(jnp.isneginf(la), mb, jnp.where(jnp.isneginf(lb), ma, jnp.maximum(ma, mb)))
        la, lb = la + (ma - m), lb + (mb - m)
        log_sum = merged_lse(la, lb)
        shift = safe_max(log_sum)
        wa, wb = (expand(jnp.exp(w - shift), oa.ndim) for w in (la, lb))
        return oa * wa.astype(oa.dtype) + ob * wb.astype(ob.dtype), m, log_sum

    def finish(self, first, stats):
        s_type, v_type = first[:2]
        out, m, log_sum = stats
        lse = m + log_sum
        lse_low = jnp.where(jnp.isfinite(lse), (m - lse) + log_sum, 0.0)
        # The backward's rowsum(dO * O) needs the unrounded output: with a bfloat16 one,
        # dq and dk came out up to 1.4x less accurate than dense attention's.
        return (out.astype(v_type.dtype), lse.astype(s_type.dtype)), (out, lse, lse_low)

    def row_cotangents(self, residual, ct, batch_ndim, result):
        out, lse, lse_low = residual
        ct_out = dense(ct[0], out)
        ct_lse = dense(ct[1], lse).astype(lse.dtype)
        # The value dims: after the batch dims, the row and the heads (lse's dims).
        delta = jnp.sum(ct_out.astype(lse.dtype) * out, axis=tuple(range(lse.ndim, out.ndim)))
        return [ct_out, ct_lse - delta, lse, lse_low]

    def score_cotangent(self, out, row_data, r_valid, c_valid, c_ids):
        s, vals = out[:2]
        nh = s.ndim - 2
        dv = self._dims(s.ndim, vals.ndim)[1]
        # The rows' data with the heads leading, as in the tile.
        ct_out, ct_lse_minus_delta, lse, lse_low = (jnp.moveaxis(a, 0, nh) for a in row_data)
        acc = lse.dtype
        seen = r_valid & jnp.isfinite(lse)
        valid = c_valid & seen[..., None]
        shifted = s.astype(acc) - safe_max(lse)[..., None]
        p = jnp.where(valid, jnp.exp(shifted - lse_low[..., None]), 0.0)
        rows, v_acc, hl = _grouped(s, vals.astype(acc))
        ct_acc = rows(ct_out.astype(acc))
        dp = jnp.einsum(f"{hl}r{dv},{hl}j{dv}->{hl}rj", ct_acc, v_acc).reshape(s.shape)
        # With value weights w: out = sum_j p_j w_j v_j, so d/ds_j = p_j (w_j dp_j - delta)
        # (FlashAttention's dropout backward); the weights themselves get no gradient.
        pw = p if len(out) == 2 else p * out[2].astype(acc)
        if len(out) == 3:
            dp = dp * out[2].astype(acc)
        ds = p * (dp + ct_lse_minus_delta[..., None])
        # A value head shared otherwise (size 1 in vals) sums over the heads it serves.
        v_h = "".join(c for i, c in enumerate(hl) if v_acc.shape[i] != 1 or s.shape[i] == 1)
        d_vals = jnp.einsum(f"{hl}rj,{hl}r{dv}->{v_h}j{dv}", rows(pw), ct_acc)
        d_vals = d_vals.reshape(vals.shape).astype(vals.dtype)
        if len(out) == 2:
            return ds.astype(s.dtype), d_vals
        return ds.astype(s.dtype), d_vals, jnp.zeros_like(out[2])

    def combine_over_devices(self, local, axes, m_local):
        """``local`` is the result ``(out, lse)``."""
        out, lse = local
        total = LogSumExp().combine_over_devices(lse, axes, m_local)
        weight = expand(jnp.exp(lse - safe_max(total)), out.ndim)
        return lax.psum(out * weight.astype(out.dtype), axes), total

    def empty(self, n, shape, dtype):
        return None


REDUCTIONS: dict[str, Reduction] = {
    r.name: r for r in (Sum(), LogSumExp(), LogSumExpAndPick(), Max(), Softmax())
}
