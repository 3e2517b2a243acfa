"""Memory-efficient softmax attention whose backward pass is tiled too.

``softmax(q k^T / sqrt(d) + bias, masked) v`` computed tile by tile with the online
softmax (Milakov & Gimelshein, arXiv:1805.02867; Rabe & Staats, *Self-attention does not
need O(n^2) memory*, arXiv:2112.05682) and differentiated with the FlashAttention
backward (Dao et al., NeurIPS 2022): the forward saves only the output and the per-row
log-sum-exp, the backward re-forms each tile's probabilities from them. It is the
``"softmax"`` reduction of :func:`memwise.chunked.tiled_reduce`; no second loop lives
here. Memory both ways: q, k, v, the output and one ``chunk_size`` tile (per batch
element and head), never the L x L score matrix.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from memwise.chunked import tiled_reduce

__all__ = ["attention"]


def _pair_operand(arr: Any, name: str, batch: tuple, lq: int, lk: int, dtype) -> tuple:
    """Bring a mask/bias to ``(lq, lk)`` (shared, vmap axis None) or ``batch + (lq, lk)``."""
    arr = jnp.asarray(arr, dtype)
    try:
        full = jnp.broadcast_shapes(arr.shape, batch + (lq, lk))
    except ValueError as e:
        raise ValueError(
            f"{name} of shape {arr.shape} does not broadcast to (..., Lq, Lk) = "
            f"{batch + (lq, lk)}"
        ) from e
    if full != batch + (lq, lk):
        raise ValueError(f"{name} of shape {arr.shape} would enlarge the output shape")
    arr = jnp.broadcast_to(arr, arr.shape[:-2] + (lq, lk)) if arr.ndim >= 2 else (
        jnp.broadcast_to(arr, (lq, lk))
    )
    lead = arr.shape[:-2]
    if all(s == 1 for s in lead):
        return arr.reshape(lq, lk), None
    # A mask varying over only some batch dims is broadcast here (one copy).
    arr = jnp.broadcast_to(arr, batch + (lq, lk))
    return arr.reshape((-1, lq, lk)), 0


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mask: jax.Array | None = None,
    bias: jax.Array | None = None,
    causal: bool = False,
    scale: float | None = None,
    chunk_size: int | tuple[int, int] | str = "auto",
) -> jax.Array:
    """Softmax attention ``softmax(q k^T * scale + bias) v`` in tiles, forward and backward.

    Shapes: ``q (..., Lq, d)``, ``k (..., Lk, d)``, ``v (..., Lk, dv)`` with equal leading
    (batch, heads, ...) dims; returns ``(..., Lq, dv)``. ``mask`` (bool, True = attend) and
    ``bias`` broadcast to ``(..., Lq, Lk)``; they are sliced tile by tile, never copied
    when shared across the batch. ``causal=True`` lets query ``i`` see keys ``j <= i``.
    A query that sees no key returns zeros. Gradients: q, k, v and ``bias``.

    Memory: O(L d) per head plus one ``(rows, cols)`` tile of scores, in both passes
    (the L x L matrix is never formed). Compute: the backward re-forms each tile's
    probabilities from the saved per-row log-sum-exp, about 2.5 forward passes.

    Args:
      q, k, v: queries, keys, values.
      mask: optional boolean array broadcastable to ``(..., Lq, Lk)``.
      bias: optional float array broadcastable to ``(..., Lq, Lk)``, added to the scores.
      causal: mask keys after the query position.
      scale: score scale; default ``1 / sqrt(d)``.
      chunk_size: tile ``(query rows, key cols)``, an int, or ``"auto"``.

    Example::

        >>> import jax, jax.numpy as jnp, memwise as mw
        >>> q = k = v = jnp.ones((2, 4, 100, 16))     # batch, heads, length, dim
        >>> mw.attention(q, k, v, causal=True, chunk_size=(32, 64)).shape
        (2, 4, 100, 16)
    """
    q, k, v = (jnp.asarray(a) for a in (q, k, v))
    if q.ndim < 2 or k.ndim < 2 or v.ndim < 2:
        raise ValueError(
            f"q, k, v need shape (..., L, d); got {q.shape}, {k.shape}, {v.shape}"
        )
    batch = q.shape[:-2]
    if k.shape[:-2] != batch or v.shape[:-2] != batch:
        raise ValueError(
            f"q, k, v must share their leading (batch, head) dims; got {q.shape}, "
            f"{k.shape}, {v.shape}"
        )
    lq, d = q.shape[-2:]
    lk = k.shape[-2]
    if k.shape[-1] != d:
        raise ValueError(f"q and k need the same feature dim; got {d} and {k.shape[-1]}")
    if v.shape[-2] != lk:
        raise ValueError(f"k and v need the same length; got {lk} and {v.shape[-2]}")
    if not all(jnp.issubdtype(a.dtype, jnp.floating) for a in (q, k, v)):
        raise TypeError(f"q, k, v must be float arrays, got {q.dtype}, {k.dtype}, {v.dtype}")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    dtype = jnp.result_type(q, k, v)

    pairs: dict = {}
    pair_axes: dict = {}
    if mask is not None:
        pairs["mask"], pair_axes["mask"] = _pair_operand(mask, "mask", batch, lq, lk, bool)
    if bias is not None:
        pairs["bias"], pair_axes["bias"] = _pair_operand(bias, "bias", batch, lq, lk, dtype)

    def tile_fn(qb, kv, pb, _consts, row_ids, col_ids):
        s = jnp.dot(qb, kv["k"].T, preferred_element_type=dtype) * jnp.asarray(scale, dtype)
        if "bias" in pb:
            s = s + pb["bias"]
        keep = None
        if "mask" in pb:
            keep = pb["mask"]
        if causal:
            c = col_ids[None, :] <= row_ids[:, None]
            keep = c if keep is None else keep & c
        if keep is not None:
            s = jnp.where(keep, s, -jnp.inf)
        return s, kv["v"]

    def one(qh, kh, vh, ph):
        out, _ = tiled_reduce(
            tile_fn, qh, {"k": kh, "v": vh}, reduce="softmax", chunk_size=chunk_size,
            pairs=ph, pair_bytes=16 * int(np.prod(batch, dtype=np.int64)),
        )
        return out

    qf = q.reshape((-1, lq, d))
    kf = k.reshape((-1, lk, d))
    vf = v.reshape((-1, lk) + v.shape[-1:])
    out = jax.vmap(one, in_axes=(0, 0, 0, pair_axes))(qf, kf, vf, pairs)
    return out.reshape(batch + (lq,) + v.shape[-1:])
