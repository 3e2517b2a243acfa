"""The tiles of softmax attention, shared by every attention front end.

One ``"softmax"`` reduction of :func:`memwise.engine.tiled_reduce` computes
``softmax(cap(q k^T * scale) + bias, masked) v`` for :func:`memwise.attention` (layout
``(..., L, d)``) and :func:`memwise.dot_product_attention` (layout ``(B, T, N, H)``).
This module only builds the tile: its scores, the visibility of each query-key pair
(causal, a sliding window, segment ids, padding lengths, a boolean mask) and dropout's
value weights; and the predicate that skips a tile no pair of which is visible
(block sparsity, as Splash attention does), in both passes.

Dropout (Srivastava et al., JMLR 2014, applied to the attention weights as in Flax and
FlashAttention) draws its keep mask from a counter-based hash of ``(key, problem, query
position, key position)``: each tile regenerates its part of the mask in the forward and
the backward from the key alone, so no mask is stored and the mask does not depend on
the tile sizes. The hash is the "lowbias32" integer mixer (Wellons, *Prospecting for hash
functions*, 2018), two rounds per element; its bits are not of cryptographic quality,
which dropout does not need.

Heads: either batch dims in front of the sequence (``(..., L, d)``, heads-first), or,
with ``groups=(K, G)``, inside the tile (``(B, T, K, G, H)`` queries against
``(B, S, K, H)`` keys, ``jax.nn.dot_product_attention``'s layout): a tile then holds
its rows' scores for every head, ``(K, G, R, C)``, one softmax per head (the engine's
``"softmax"`` reduction with leading head dims), and nothing is moved to a heads-first
copy in either pass. Grouped-query attention: each K/V head serves its ``G`` query
heads inside the tile (heads-first: ``k`` and ``v`` with 1 for the group's batch dim);
K/V are never repeated beyond one tile and their gradients keep their own size.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from memwise._arguments import positive_int
from memwise._dtypes import accumulation_dtype
from memwise.engine import Ring, tiled_reduce
from memwise.engine.kernels import Pattern
from memwise.tiling import ChunkSize, DeviceShare, Tiling, item_bytes, tiling

__all__ = ["Visibility", "attend", "check_stripes", "dropout_rows", "stripe_count"]


@dataclasses.dataclass(frozen=True)
class Visibility:
    """The static part of which keys a query sees, and dropout's rate: the one encoding
    every form of it is derived from.

    ``window = (left, right)``: query ``i`` sees keys ``i - left <= j <= i + right``
    (``jax.nn.dot_product_attention``'s ``local_window_size``). ``softcap``: scores
    become ``softcap * tanh(s / softcap)`` before the bias and masks.

    Derived forms, as splash attention derives its block tables from one mask object:
    :attr:`offsets` (the range of ``j - i`` a visible pair has: what a fused kernel's
    mask is built from), :meth:`pair_mask` (a tile's pairs, in ``tile_fn``),
    :meth:`tile_may_see` (whether a tile can hold a visible pair: the engine's ``live``)
    and :attr:`band` (the engine's ``band``). Masks, padding lengths and segment ids are
    operands, not part of it.
    """

    causal: bool = False
    window: tuple[int, int] | None = None
    softcap: float | None = None
    dropout_rate: float = 0.0

    @property
    def offsets(self) -> tuple[int | None, int | None]:
        """``(lo, hi)``: query position ``i`` sees key position ``j`` only if
        ``lo <= j - i <= hi`` (``None``: no bound on that side)."""
        lo, hi = (None, None) if self.window is None else (-self.window[0], self.window[1])
        if self.causal:
            hi = 0 if hi is None else min(hi, 0)
        return lo, hi

    @property
    def by_position(self) -> bool:
        """Whether positions hide some pairs (causal or a window): tiles may be skipped."""
        return self.offsets != (None, None)

    @property
    def band(self) -> tuple[int, int] | None:
        """The engine's ``band``: :attr:`offsets` when both are bounded, else None (for
        keys and queries whose positions are their indices)."""
        lo, hi = self.offsets
        return None if lo is None or hi is None else (lo, hi)

    def pair_mask(
        self, q_pos: jax.Array, k_pos: jax.Array, keep: jax.Array | None = None
    ) -> jax.Array | None:
        """The pairs of ``keep`` (None: all) visible by position (``q_pos`` and ``k_pos``
        broadcast against each other, e.g. ``(R, 1)`` and ``(1, C)``); None: all are.

        The causal and window tests stay apart, each against the key positions (the
        form the compiled memory was measured with: one test from the offsets changed a
        causal window's gradient temporaries by 520 bytes)."""

        def both(extra: jax.Array) -> jax.Array:
            return extra if keep is None else keep & extra

        if self.causal:
            keep = both(k_pos <= q_pos)
        if self.window is not None:
            left, right = self.window
            keep = both((q_pos <= k_pos + left) & (q_pos >= k_pos - right))
        return keep

    def tile_may_see(
        self, first_q: jax.Array, last_q: jax.Array, first_k: jax.Array, last_k: jax.Array
    ) -> jax.Array:
        """Whether queries at positions in ``[first_q, last_q]`` and keys in ``[first_k,
        last_k]`` hold a pair :meth:`pair_mask` keeps (exact for whole ranges: ``j - i``
        then covers ``[first_k - last_q, last_k - first_q]``, which must meet
        :attr:`offsets`)."""
        ok = jnp.asarray(True)
        if self.causal:
            ok &= first_k <= last_q
        if self.window is not None:
            left, right = self.window
            ok &= (last_k >= first_q - left) & (first_k <= last_q + right)
        return ok

    def may_hide_whole_rows(self, q_length: int, kv_length: int) -> bool:
        """Whether a query may see no key by position alone: a causal query sees key 0,
        and within a window query ``i`` sees key ``i`` if ``i < kv_length``."""
        return self.window is not None and q_length > kv_length


def _mix(x: jax.Array) -> jax.Array:
    """lowbias32: a bijective uint32 mixer with low bias (see the module docstring)."""
    x = x ^ (x >> 16)
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> 16)


def dropout_rows(
    seed: jax.Array, batch: tuple[int, ...], length: int, *, shared: bool = False
) -> jax.Array:
    """Per query row a uint32 hash of ``(seed[0], problem, position)``, shape
    ``batch + (length,)``: a row operand of the tiles (4 bytes per query and head).
    ``shared``: one mask for every problem (Flax's ``broadcast_dropout=True``)."""
    problems = int(np.prod(batch, dtype=np.int64))
    p = jnp.arange(problems, dtype=jnp.uint32).reshape(batch + (1,))
    if shared:
        p = jnp.zeros(batch + (1,), jnp.uint32)
    t = jnp.arange(length, dtype=jnp.uint32)
    return _mix(_mix(p * np.uint32(0x9E3779B1) + seed[0]) ^ t)


def stripe_count(stripes: Any, prefix: str) -> int:
    """``stripes`` as an int >= 1 (the ``s`` of :func:`memwise.stripe`), or a clear error."""
    return positive_int(stripes, f"{prefix}stripes", accepts=" (as given to mw.stripe)")


def check_stripes(stripes: Any, lq: int, lk: int) -> tuple[int, int, int] | None:
    """``(s, Lq, Lk)`` for :func:`attend`, or None; a clear error for a bad ``stripes``."""
    if stripes is None:
        return None
    stripes = stripe_count(stripes, "")
    if lq != lk or lq % stripes:
        raise ValueError(
            f"stripes={stripes} needs q and k of one length divisible by it (the striped "
            f"order of mw.stripe(x, {stripes})); got Lq={lq}, Lk={lk}: pad the sequence to a "
            f"multiple of {stripes}"
        )
    return stripes, lq, lk


def _keep_mask(row_hash: jax.Array, col_ids: jax.Array, seed1: jax.Array, rate: float) -> jax.Array:
    """The tile's dropout keep mask: ``P(keep) = 1 - rate`` per pair, from the hashes
    (``row_hash heads + (R,)``: the mask is ``heads + (R, C)``)."""
    c = col_ids.astype(jnp.uint32) * np.uint32(0x85EBCA77) + seed1
    bits = _mix(_mix(row_hash[..., None] ^ c) + np.uint32(0x27D4EB2F))
    threshold = np.uint32(min(int(rate * 2.0**32), 2**32 - 1))
    return bits >= threshold


def _heads_first(rows: dict) -> dict:
    """A row block's queries ``(R, K, G, H)`` as ``(K, G, R, H)``, the layout of a batched
    matmul, once per block (the engine's ``row_layout``); the other row operands stay."""
    return {**rows, "q": jnp.transpose(rows["q"], (1, 2, 0, 3))}


def _pair_bytes(q: jax.Array, k: jax.Array, v: jax.Array, problems: int) -> int:
    """One query-key pair's score and weight, for every (batch, head) at once."""
    dtype = accumulation_dtype(jnp.result_type(q, k, v))
    d = q.shape[-1]
    score = lambda qi, kj: jnp.exp(jnp.dot(qi, kj))  # noqa: E731
    return item_bytes(score, jnp.zeros(d, dtype), jnp.zeros(d, dtype)) * problems


def _clamped(table: jax.Array, ids: jax.Array) -> jax.Array:
    """``table[..., ids]`` with the padding slots of a last tile clamped to a real item
    (a liveness test may over-approximate, never under)."""
    return table[..., jnp.clip(ids, 0, table.shape[-1] - 1)]


def unstriped_position(index: jax.Array, stripes: int, length: int) -> jax.Array:
    """The position before :func:`memwise.stripe` of index ``index`` of a striped axis:
    index ``d * (length // stripes) + i`` holds position ``i * stripes + d``."""
    per_stripe = length // stripes
    return (index % per_stripe) * stripes + index // per_stripe


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    scale: jax.Array,
    visibility: Visibility = Visibility(),
    chunk_size: ChunkSize = "auto",
    mask: jax.Array | None = None,
    bias: jax.Array | None = None,
    q_segments: jax.Array | None = None,
    kv_segments: jax.Array | None = None,
    q_keep: jax.Array | None = None,
    kv_keep: jax.Array | None = None,
    live_segments: tuple[jax.Array, jax.Array] | None = None,
    live_lengths: tuple[jax.Array | None, jax.Array | None] = (None, None),
    dropout: tuple[jax.Array, jax.Array] | None = None,
    row_offset: jax.Array | None = None,
    ring: Ring | None = None,
    stripes: tuple[int, int, int] | None = None,
    groups: tuple[int, int] | None = None,
    caller: str = "memwise.attention",
    auto_shape: DeviceShare | None = None,
    implementation: str | None = None,
    lse_unused: bool = False,
    value_dtype: Any = None,
) -> tuple[jax.Array, jax.Array]:
    """``(out, lse)`` of attention in tiles: ``out`` in the values' dtype, the per-row
    log-sum-exp in float32 (``-inf`` where a query sees no key, ``out`` 0 there).

    Shapes, with ``batch = q.shape[:-2]``: ``q batch + (T, H)``; ``k``, ``v``
    ``kbatch + (S, H)`` where each dim of ``kbatch`` is that of ``batch`` or 1 (shared);
    ``mask``/``bias`` ``batch + (T, S)`` with 1 on the dims they broadcast over;
    ``q_segments``/``q_keep`` (whether a query row is real) ``batch + (T,)``;
    ``kv_segments``/``kv_keep`` ``kbatch + (S,)``. With ``groups=(K, G)`` the heads are
    inside the tiles instead: ``q batch + (T, K, G, H)``, ``k``, ``v`` ``batch + (S, K,
    H)``, masks, segments and keeps as above (shared by every head), the row hashes
    ``batch + (T, K, G)``; ``out`` is ``batch + (T, K, G, Hv)``, ``lse``
    ``batch + (T, K, G)``. ``live_segments``: the same segment
    ids as whole ``(B, T)`` and ``(B, S)`` tables (any common leading ``B``; on a ring
    too) from which a tile is found invisible; ``live_lengths``: the largest query and key length over the
    batch (or None). ``dropout``: ``(seed (2,) uint32, row hashes batch + (T,))`` from
    :func:`dropout_rows`. ``row_offset``: the global index of the first query.
    ``stripes``: ``(s, Lq, Lk)`` when q and k are in :func:`memwise.stripe`'s order of
    ``s`` stripes (global lengths ``Lq``, ``Lk``): causal masks, windows, the length
    skips and the dropout mask's columns use the positions before striping (``q_keep``,
    ``kv_keep`` and the row hashes are the caller's, in the striped order).
    ``auto_shape``: the device's share of a ring step a ``"auto"`` tile is chosen for
    (:func:`memwise.tiling.tiling`). ``implementation``: the engine's backend choice
    (:mod:`memwise.engine.kernels`); an explicit ``chunk_size`` sets a fused kernel's
    block sizes too; ``lse_unused``: the caller
    does not read ``lse`` outside differentiation (a kernel may then skip writing it);
    ``value_dtype``: the dtype ``v`` had before the caller upcast it (exactly), which a
    kernel may read it in.
    Gradients: q, k, v, bias and a traced scale. ``caller`` names the public function in the error forward mode raises.
    """
    heads = 0 if groups is None else 2  # q's head dims after the sequence axis
    batch = q.shape[: q.ndim - 2 - heads]
    lq, lk = q.shape[len(batch)], k.shape[len(batch)]
    problems = int(np.prod(batch + (groups or ()), dtype=np.int64))
    rows, cols, pairs, consts = _tile_operands(
        q,
        k,
        v,
        scale=scale,
        mask=mask,
        bias=bias,
        q_segments=q_segments,
        kv_segments=kv_segments,
        q_keep=q_keep,
        kv_keep=kv_keep,
        live_segments=live_segments,
        live_lengths=live_lengths,
        dropout=dropout,
        row_offset=row_offset,
    )
    skips = (
        visibility.by_position
        or live_segments is not None
        or any(n is not None for n in live_lengths)
    )
    # Positions that are the indices (unshifted, unstriped): a window is a band of them.
    indexed = stripes is None and row_offset is None and ring is None
    band = visibility.band if indexed else None
    tiles, requested = _resolve_tiles(
        lq,
        lk,
        chunk_size,
        pair_bytes=lambda: _pair_bytes(q, k, v, problems),
        auto_shape=auto_shape,
        band=band,
        groups=groups,
    )
    return tiled_reduce(
        _tile_function(visibility, groups, stripes),
        rows,
        cols,
        reduce="softmax",
        tiles=tiles,
        pairs=pairs,
        consts=consts,
        batch=batch,
        upcast=True,
        live=_live_predicate(visibility, stripes) if skips else None,
        band=band,
        ring=ring,
        # A fused attention kernel registered for this platform may take the call
        # (memwise.engine.kernels): the leaves are the dicts above, by these names.
        pattern=_kernel_pattern(
            visibility,
            groups,
            (rows, cols, pairs, consts),
            stripes=stripes,
            requested=requested,
            lse_unused=lse_unused,
            value_dtype=value_dtype,
        ),
        implementation=implementation,
        row_layout=None if groups is None else _heads_first,
        forward_mode_error=_FORWARD_MODE.format(caller=caller),
    )


_FORWARD_MODE = (
    "{caller} supports reverse mode (grad, vjp, jacrev; also jax.hessian and "
    "jacfwd of grad) and vmap, but not forward mode through it (jvp, jacfwd, "
    "jax.linearize); for forward mode use jax.nn.dot_product_attention "
    "(implementation='xla'), or differentiate in reverse mode"
)


def _kernel_pattern(
    vis: Visibility,
    groups: tuple[int, int] | None,
    operands: tuple[dict, dict, dict, dict],
    *,
    stripes: tuple[int, int, int] | None,
    requested: tuple[int, int, int, int] | None,
    lse_unused: bool,
    value_dtype: Any,
) -> Pattern:
    """What the tiles compute, for a fused kernel to recognise: the static options and
    the names of the operands present."""
    rows, cols, pairs, consts = operands
    return Pattern(
        "dot_product_attention",
        (
            ("visibility", vis),
            ("groups", groups),
            ("rows", tuple(sorted(rows))),
            ("cols", tuple(sorted(cols))),
            ("pairs", tuple(sorted(pairs))),
            ("consts", tuple(sorted(consts))),
            ("stripes", stripes),
            ("chunk_size", requested),
            ("lse_unused", lse_unused),
            ("value_dtype", None if value_dtype is None else jnp.dtype(value_dtype).name),
        ),
    )


def _tile_operands(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    scale: jax.Array,
    mask: jax.Array | None,
    bias: jax.Array | None,
    q_segments: jax.Array | None,
    kv_segments: jax.Array | None,
    q_keep: jax.Array | None,
    kv_keep: jax.Array | None,
    live_segments: tuple[jax.Array, jax.Array] | None,
    live_lengths: tuple[jax.Array | None, jax.Array | None],
    dropout: tuple[jax.Array, jax.Array] | None,
    row_offset: jax.Array | None,
) -> tuple[dict, dict, dict, dict]:
    """The engine's ``(rows, cols, pairs, consts)``: each operand of :func:`attend` under
    the name the tile (and a fused kernel) reads it by."""
    rows: dict = {"q": q}
    cols: dict = {"k": k, "v": v}
    pairs: dict = {}
    consts: dict = {"scale": scale}
    if mask is not None:
        pairs["mask"] = mask
    if bias is not None:
        pairs["bias"] = bias
    if q_segments is not None:
        rows["seg"], cols["seg"] = q_segments, kv_segments
    if q_keep is not None:
        rows["keep"] = q_keep
    if kv_keep is not None:
        cols["keep"] = kv_keep
    if dropout is not None:
        rows["hash"] = dropout[1]
        consts["seed"] = dropout[0]
    if row_offset is not None:
        consts["offset"] = row_offset
    if live_segments is not None:
        consts["live_segments"] = live_segments
    for name, length in zip(("live_q_length", "live_kv_length"), live_lengths):
        if length is not None:
            consts[name] = length
    return rows, cols, pairs, consts


def _global_rows(row_ids: jax.Array, consts: dict) -> jax.Array:
    """The ids of this device's queries in the whole sequence."""
    return row_ids + consts["offset"] if "offset" in consts else row_ids


def _query_positions(
    row_ids: jax.Array, consts: dict, stripes: tuple[int, int, int] | None
) -> jax.Array:
    """The queries' positions in the sequence (before :func:`memwise.stripe`)."""
    index = _global_rows(row_ids, consts)
    return index if stripes is None else unstriped_position(index, stripes[0], stripes[1])


def _key_positions(col_ids: jax.Array, stripes: tuple[int, int, int] | None) -> jax.Array:
    """The keys' positions in the sequence (before :func:`memwise.stripe`)."""
    return col_ids if stripes is None else unstriped_position(col_ids, stripes[0], stripes[2])


def _tile_function(
    vis: Visibility, groups: tuple[int, int] | None, stripes: tuple[int, int, int] | None
) -> Any:
    """The engine's ``tile_fn``: a tile's scores (``-inf`` where a pair is not visible),
    its values and, with dropout, its value weights."""

    def tile_fn(r, c, p, consts, row_ids, col_ids):
        # Scores in at least float32 from bfloat16/float16 inputs (float32 accumulation,
        # as jax.nn.dot_product_attention); the engine keeps the softmax in float32 too.
        score_dtype = accumulation_dtype(jnp.result_type(r["q"], c["k"]))
        if groups is None:
            s = jnp.dot(r["q"], c["k"].T, preferred_element_type=score_dtype)
            vals = c["v"]
        else:  # (K, G, R, C): each K/V head against its group of query heads, whose
            # rows are one matmul dim (so dK is one product, not a sum over the group)
            kh, g, rows, d = r["q"].shape
            q = r["q"].reshape(kh, g * rows, d)
            s = jnp.einsum("krh,ckh->krc", q, c["k"], preferred_element_type=score_dtype)
            s = s.reshape(kh, g, rows, -1)
            vals = jnp.moveaxis(c["v"], 0, 1)[:, None]  # (K, 1, C, Hv): serves the group
        s = s * consts["scale"].astype(score_dtype)
        if vis.softcap is not None:
            s = vis.softcap * jnp.tanh(s / vis.softcap)
        if "bias" in p:
            s = s + p["bias"].astype(score_dtype)
        keep = p.get("mask")

        def both(extra):
            return extra if keep is None else keep & extra

        keep = vis.pair_mask(
            _query_positions(row_ids, consts, stripes)[:, None],
            _key_positions(col_ids, stripes)[None, :],
            keep,
        )
        if "seg" in r:
            keep = both(r["seg"][:, None] == c["seg"][None, :])
        if "keep" in r:
            keep = both(r["keep"][:, None])
        if "keep" in c:
            keep = both(c["keep"][None, :])
        if keep is not None:
            s = jnp.where(keep, s, -jnp.inf)
        if "hash" not in r:
            return s, vals
        row_hash = r["hash"] if groups is None else jnp.moveaxis(r["hash"], 0, -1)
        kept = _keep_mask(
            row_hash, _key_positions(col_ids, stripes), consts["seed"][1], vis.dropout_rate
        )
        weights = jnp.where(kept, 1.0 / (1.0 - vis.dropout_rate), 0.0).astype(score_dtype)
        return s, vals, weights

    return tile_fn


def _live_predicate(vis: Visibility, stripes: tuple[int, int, int] | None) -> Any:
    """The engine's ``live``: whether any pair of a tile can be visible."""

    def live(row_ids, col_ids, consts):
        # From position ranges (a tile is a contiguous block of indices, whose positions
        # are contiguous within each stripe) and, for segments, every batch row's ids.
        pos, kpos = _query_positions(row_ids, consts, stripes), _key_positions(col_ids, stripes)
        first_q, last_q, first_k, last_k = pos.min(), pos.max(), kpos.min(), kpos.max()
        ok = vis.tile_may_see(first_q, last_q, first_k, last_k)
        if "live_q_length" in consts:
            ok &= first_q < consts["live_q_length"]
        if "live_kv_length" in consts:
            ok &= first_k < consts["live_kv_length"]
        if "live_segments" in consts:
            q_seg, kv_seg = consts["live_segments"]
            rows_seg = _clamped(q_seg, _global_rows(row_ids, consts))
            same = rows_seg[:, :, None] == _clamped(kv_seg, col_ids)[:, None, :]
            ok &= jnp.any(same)
        return ok

    return live


def _resolve_tiles(
    lq: int,
    lk: int,
    chunk_size: ChunkSize,
    *,
    pair_bytes: Any,
    auto_shape: DeviceShare | None,
    band: tuple[int, int] | None,
    groups: tuple[int, int] | None,
) -> tuple[Tiling, tuple[int, int, int, int] | None]:
    """The tiles, and the ``(rows, cols, backward rows, backward cols)`` the caller asked
    for, if any (a fused kernel's blocks follow it too)."""
    tiles = tiling(
        lq,
        lk,
        chunk_size,
        pair_bytes=pair_bytes,
        auto_shape=auto_shape,
        band=None if band is None else band[1] - band[0],
    )
    requested = None
    if not isinstance(chunk_size, str):
        forward = (tiles.rows.size, tiles.cols.size)
        requested = forward + (tiles._backward() or forward)
    if groups is not None and band is None and not isinstance(chunk_size, Tiling):
        # With the heads inside the tile, each backward tile moves its K/V block's heads
        # first and back (once per tile, as the forward): at half the forward's rows this
        # cost the gradient 1.16x its time at T = 4,096 with 8 heads, so the backward
        # runs the forward's tile (a ``Tiling`` given as chunk_size still sets its own).
        size = (tiles.rows.size, tiles.cols.size)
        tiles = tiling(lq, lk, size, backward=size)
    return tiles, requested
