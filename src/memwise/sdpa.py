"""A drop-in for ``jax.nn.dot_product_attention`` that runs in tiles, forward and backward.

``dot_product_attention(query, key, value, bias, mask, *, scale, is_causal,
query_seq_lengths, key_value_seq_lengths, local_window_size, ...)`` takes
``jax.nn.dot_product_attention``'s arguments, layout (``(B, T, N, H)`` or unbatched
``(T, N, H)``), broadcasting and semantics, so that replacing the function's name is the
whole change; it returns the same values and gradients with memory O(T H) per head plus
one tile of scores in both passes (the T x S matrix is never formed). Underneath is the
one tile engine (:func:`memwise.engine.tiled_reduce`, reduction ``"softmax"``: the
online softmax and the FlashAttention backward, Dao et al., NeurIPS 2022) through the
tiles :func:`memwise.attention` uses too (:mod:`memwise._attention_tiles`).

Grouped-query and multi-query attention (Ainslie et al., *GQA*, EMNLP 2023; Shazeer,
*Fast transformer decoding*, 2019): the N query heads are viewed as (K, G), K key/value
heads of G query heads each, and each K/V head serves its group inside the tiles; K and
V are never repeated and their gradients have their own size.

Beyond ``jax.nn`` (what Splash attention and FlashAttention-2/3 offer): segment ids for
packed sequences, a logit soft-cap (Gemma 2), attention sinks (a learned per-head logit
in the softmax denominator, as in gpt-oss; Xiao et al., *Efficient streaming language
models with attention sinks*, 2023), dropout on the attention weights regenerated per
tile, and the per-row log-sum-exp. Tiles that the causal mask, a window, padding lengths
or segment boundaries make invisible are skipped in both passes.

Semantics kept from ``jax.nn`` (its XLA implementation) where a plain softmax would
differ: a query that sees no key (fully masked) returns the mean of all values (masked
scores are a large negative number there, not -inf), and queries past
``query_seq_lengths`` return zeros. Where it differs, on purpose: a query whose keys a
``bias`` of ``-inf`` hides (all of them, or those the masks leave) returns the mean of
all values, as a fully masked one; ``jax.nn`` returns NaN when the bias hides every key,
and the mean of the values at the keys the mask hides when mask and bias share the row
(its large negative mask score beats ``-inf``). Matching that would take one more pass
over the mask's tiles; a finite bias (``-1e9``) gives the same result in both in float32
and below. In float64 memwise keeps the scores in float64 where ``jax.nn`` rounds them to
float32 first: a row that ``-1e9`` hides entirely is then ``jax.nn``'s mean of the values
(``s - 1e9`` rounds to ``-1e9``) and memwise's exact softmax of ``s``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from memwise._arguments import as_array
from memwise._attention_tiles import Visibility, attend, dropout_rows, unstriped_position
from memwise._dtypes import accumulation_dtype
from memwise._sdpa_args import Checked, check_options, validate
from memwise._sdpa_split import run_split, sequence_split
from memwise.tiling import ChunkSize, tiling

__all__ = ["dot_product_attention", "flax_attention_fn"]

# jax.nn's stand-in for a masked score, in float32 (its softmax dtype).
_LARGE_NEGATIVE = -0.7 * float(np.finfo(np.float32).max)


def _grouped(arr: jax.Array, kv_heads: int, group: int) -> jax.Array:
    """A ``(B, N, T, S)``-broadcastable mask or bias as ``(B, K, G, T, S)`` (a reshape)."""
    b, n, t, s = arr.shape
    return arr.reshape((b, 1, 1, t, s) if n == 1 else (b, kv_heads, group, t, s))


# The stages of dot_product_attention, in the order it runs them: validation
# (memwise._sdpa_args.validate), the empty call (_empty_result), layout (_layout),
# operands (_operands), dispatch (_dispatch, _run_tiles) and corrections (_corrections).


def _empty_result(
    call: Checked, chunk_size: ChunkSize, return_residual: bool
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The dense result of a call with no query, key, head or batch element."""
    if chunk_size != "auto":
        tiling(1, 1, chunk_size)  # still a valid size
    # Nothing to attend to gives zeros (jax.nn's empty sums).
    out = jnp.zeros(call.out_lead + call.v.shape[-1:], call.q.dtype)
    # jax.nn's log-sum-exp over no key is -inf (its masked scores are finite).
    S = call.k.shape[1]
    lse = jnp.full(call.out_lead, -jnp.inf if S == 0 else _LARGE_NEGATIVE, jnp.float32)
    lse = lse.astype(call.q.dtype)
    return (out, lse) if return_residual else out


@dataclasses.dataclass(frozen=True)
class _Layout:
    """The operands in the layout the tiles read them: the inputs' own ``(B, T, K, G, H)``
    with the heads inside each tile (``groups=(K, G)``), or heads-first ``(B, K, G, T,
    H)`` (``per_head``: a mask or bias with a head dim)."""

    per_head: bool
    q: jax.Array
    k: jax.Array
    v: jax.Array
    mask: jax.Array | None
    bias: jax.Array | None
    groups: tuple[int, int] | None
    values: jax.Array  # v in (B, S, K, Hv), in the dtype the corrections read
    q_valid: jax.Array | None  # (B, T): the queries before query_seq_lengths
    kv_valid: jax.Array | None  # (B, S)
    dropout: tuple[jax.Array, jax.Array] | None  # (seed, row hashes)

    @property
    def t_axis(self) -> int:
        """The queries' axis in q and in the output (what a sequence split cuts)."""
        return 3 if self.per_head else 1

    def rows_of(self, a: jax.Array) -> jax.Array:
        """A ``(B, T)`` row operand in this layout."""
        if not self.per_head:
            return a
        B, K, G, T = self.q.shape[:4]
        return jnp.broadcast_to(a[:, None, None], (B, K, G, T))

    def cols_of(self, a: jax.Array) -> jax.Array:
        """A ``(B, S)`` column operand in this layout."""
        return a[:, None, None] if self.per_head else a


def _layout(call: Checked) -> _Layout:
    """Layout: query heads as (K, G), each K/V head serving its group.

    Masks and biases shared by every head, segments, lengths and dropout are read in
    the inputs' own layout, the heads inside each tile; a per-head mask or bias (B, N,
    T, S) is sliced from its own shape in the heads-first layout (B, K, G, T, .), which
    costs a copy of q, k, v and the output moved there and back.
    """
    B, T, S, _, K, G = call.shape
    H = call.q.shape[-1]
    mask, bias, v4 = call.mask, call.bias, call.v
    per_head = any(a is not None and a.shape[1] != 1 for a in (mask, bias))
    acc = accumulation_dtype(call.q.dtype)
    if acc != jnp.dtype(v4.dtype) and (call.sinks is not None or call.may_see_nothing):
        # The per-row corrections (the sink's share, the values' mean for a query that
        # sees nothing) then act on the unrounded output, and the mean's gradient joins
        # dV before its one rounding: a bfloat16 dV was off by up to one ulp instead of
        # half. Costs a float32 copy of V.
        v4 = v4.astype(acc)
    # Each index's position in the sequence (in mw.stripe's order, not the index).
    striped = call.stripes
    q_pos = jnp.arange(T) if striped is None else unstriped_position(jnp.arange(T), *striped[:2])
    kv_pos = q_pos if striped is not None else jnp.arange(S)
    q_valid = None if call.q_len is None else q_pos < call.q_len[:, None]  # (B, T)
    kv_valid = None if call.kv_len is None else kv_pos < call.kv_len[:, None]
    dropout = None
    if call.seed is not None:
        row_hash = dropout_rows(call.seed, (B, K, G), T, shared=call.dropout_broadcast)
        row_hash = row_hash if striped is None else row_hash[..., q_pos]
        dropout = (call.seed, row_hash if per_head else row_hash.transpose(0, 3, 1, 2))
    if per_head:
        qg = call.q.reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4)
        kg, vg = (a.transpose(0, 2, 1, 3)[:, :, None] for a in (call.k, v4))
        mask, bias = (None if a is None else _grouped(a, K, G) for a in (mask, bias))
        groups = None
    else:
        qg, kg, vg = call.q.reshape(B, T, K, G, H), call.k, v4
        mask, bias = (None if a is None else a[:, 0] for a in (mask, bias))  # (B, T, S)
        groups = (K, G)
    return _Layout(per_head, qg, kg, vg, mask, bias, groups, v4, q_valid, kv_valid, dropout)


def _operands(call: Checked, layout: _Layout) -> tuple[dict, dict]:
    """Operands: each array the tiles read, as ``name: (array, role)``, and those read
    whole on every device (``name: value``).

    The role is the axis of its queries (``"rows"``, ``"pairs"``) or keys (``"cols"``):
    what a split over the batch or the sequence cuts. Read whole: scalars, and segment
    ids (4 bytes a token) to skip tiles.
    """
    q_seg, kv_seg, q_valid, kv_valid = call.q_seg, call.kv_seg, layout.q_valid, layout.kv_valid
    dropout = layout.dropout
    operands: dict = {"q": (layout.q, "rows"), "k": (layout.k, "cols"), "v": (layout.v, "cols")}
    optional = {
        "mask": (layout.mask, "pairs"),
        "bias": (layout.bias, "pairs"),
        "q_segments": (None if q_seg is None else layout.rows_of(q_seg), "rows"),
        "kv_segments": (None if kv_seg is None else layout.cols_of(kv_seg), "cols"),
        "q_keep": (None if q_valid is None else layout.rows_of(q_valid), "rows"),
        "kv_keep": (None if kv_valid is None else layout.cols_of(kv_valid), "cols"),
        "hash": (None if dropout is None else dropout[1], "rows"),
    }
    operands.update({name: a for name, a in optional.items() if a[0] is not None})
    whole = {
        "scale": call.scale,
        "seed": None if dropout is None else dropout[0],
        "live_segments": None if q_seg is None or kv_seg is None else (q_seg, kv_seg),
        "live_lengths": (
            None if call.q_len is None else jnp.max(call.q_len),
            None if call.kv_len is None else jnp.max(call.kv_len),
        ),
    }
    return operands, whole


@dataclasses.dataclass(frozen=True)
class _TileCall:
    """What every device's call of the tiles shares (static)."""

    visibility: Visibility
    chunk_size: ChunkSize
    groups: tuple[int, int] | None
    stripes: tuple[int, int, int] | None
    implementation: str | None
    lse_unused: bool
    value_dtype: Any


def _run_tiles(
    static: _TileCall,
    parts: dict,
    whole: dict,
    ring: Any = None,
    row_offset: Any = None,
    auto_shape: Any = None,
) -> tuple[jax.Array, jax.Array]:
    """``(out, lse)`` of the tiles over ``parts`` (one device's share, or all of them)."""
    seed = whole["seed"]
    return attend(
        parts["q"],
        parts["k"],
        parts["v"],
        scale=whole["scale"],
        visibility=static.visibility,
        chunk_size=static.chunk_size,
        caller="memwise.dot_product_attention",
        mask=parts.get("mask"),
        bias=parts.get("bias"),
        q_segments=parts.get("q_segments"),
        kv_segments=parts.get("kv_segments"),
        q_keep=parts.get("q_keep"),
        kv_keep=parts.get("kv_keep"),
        live_segments=whole["live_segments"],
        live_lengths=whole["live_lengths"],
        dropout=None if seed is None else (seed, parts["hash"]),
        groups=static.groups,
        ring=ring,
        row_offset=row_offset,
        stripes=static.stripes,
        auto_shape=auto_shape,
        implementation=static.implementation,
        lse_unused=static.lse_unused,
        value_dtype=static.value_dtype,
    )


def _dispatch(
    call: Checked,
    layout: _Layout,
    operands: dict,
    whole: dict,
    *,
    chunk_size: ChunkSize,
    implementation: str | None,
    lse_unused: bool,
) -> tuple[jax.Array, jax.Array]:
    """Dispatch: the tiles on one device, or under ``shard_map`` where the queries' data
    is split over devices (:mod:`memwise._sdpa_split`); ``(out, lse)`` in the layout."""
    B, T, S, _, _, G = call.shape
    static = _TileCall(
        call.visibility,
        chunk_size,
        layout.groups,
        call.stripes,
        implementation,
        lse_unused,
        call.q.dtype,
    )
    run = functools.partial(_run_tiles, static)
    split = sequence_split(call.q, S, (call.k, layout.values), layout.per_head and G > 1)
    if split is None:
        return run({name: a for name, (a, _) in operands.items()}, whole)
    return run_split(run, split, operands, whole, layout.t_axis, (B, T, S))


def _corrections(
    call: Checked,
    layout: _Layout,
    out: jax.Array,
    lse: jax.Array,
    *,
    return_residual: bool,
    differentiable_residual: bool,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Corrections: the per-row ones (sinks, a query that sees nothing, padded queries),
    in at least float32 (O(T) per head: never a tile), only where a row may need one:
    the output is otherwise returned as the tiles made it."""
    _, _, _, _, K, G = call.shape
    dtype = call.q.dtype
    acc = accumulation_dtype(dtype)
    if layout.per_head:  # back to (B, T, K, G, .)
        out, lse = out.transpose(0, 3, 1, 2, 4), lse.transpose(0, 3, 1, 2)
    out32 = out.astype(acc)
    if call.sinks is not None:
        sink = call.sinks.astype(acc).reshape(1, 1, K, G)
        out32 = out32 * jax.nn.sigmoid(lse - sink)[..., None]
        lse = jnp.logaddexp(lse, sink)
    elif call.may_see_nothing:
        # jax.nn: a query that sees no key averages all values (uniform weights).
        seen = jnp.isfinite(lse)
        mean_v = jnp.mean(layout.values.astype(acc), axis=1, keepdims=True)[:, :, :, None]
        out32 = jnp.where(seen[..., None], out32, mean_v)
        lse = jnp.where(seen, lse, _LARGE_NEGATIVE)
    if layout.q_valid is not None:
        out32 = jnp.where(layout.q_valid[:, :, None, None, None], out32, 0.0)
    result = out32.astype(dtype).reshape(call.out_lead + call.v.shape[-1:])
    if not return_residual:
        return result
    residual = lse.astype(dtype).reshape(call.out_lead)
    return result, residual if differentiable_residual else jax.lax.stop_gradient(residual)


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    scale: float | jax.Array | None = None,
    is_causal: bool = False,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: str | None = None,
    return_residual: bool = False,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    logit_soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    dropout_broadcast: bool = False,
    differentiable_residual: bool = False,
    stripes: int | None = None,
    chunk_size: ChunkSize = "auto",
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """``jax.nn.dot_product_attention`` in tiles: same arguments, values and gradients.

    Shapes (as ``jax.nn``): ``query (B, T, N, H)``, ``key``/``value`` ``(B, S, K, H)``
    (``value``'s last dim may differ), or all three without ``B``; ``K`` must divide
    ``N`` (grouped-query attention; ``K = 1``: multi-query), and each key/value head
    serves its ``N / K`` query heads without being repeated. Returns ``query``'s shape
    (last dim ``value``'s) in the inputs' dtype.

    Memory: the inputs, the output, a float32 log-sum-exp per query and head (and what
    rounding it lost: two floats), and one tile of scores for every head, in both
    passes; never a ``T x S`` matrix, and never K/V repeated to ``N`` heads. The inputs
    are read where they are, in their ``(B, T, N, H)`` layout, every head inside each
    tile. A mask or bias adds its own size (no more: it is sliced tile by tile from its
    own shape); one with a head dim (``N`` > 1 in ``(B, N, T, S)``) is read heads-first,
    which moves q, k, v and the output to a ``(B, N, T, H)`` copy and back (their
    gradients too). Compute: about 2.5 forward passes for the gradient; tiles that
    ``is_causal``, ``local_window_size``, the sequence lengths or the segment ids make
    invisible are skipped in both passes (a window of ``W`` keys costs about ``T * W``,
    not ``T * S``).

    Many devices: when ``query``'s data is split over its batch or sequence dim (a
    ``NamedSharding``, an Explicit-axes type under ``jit``, or a mesh with Auto axes set
    with ``jax.set_mesh``), each device attends its own queries under ``shard_map``;
    with the sequence split, ``key`` and ``value`` (their padding and segment ids with
    them) travel around the devices on a ring, or are held whole where
    :func:`memwise.sharding.use_ring` finds that cheaper, with every option above (the
    dropout mask is drawn from global positions: one device's). Segment ids are also
    read whole on every device (4 bytes a token) to skip tiles. A split over the heads is
    left to XLA's partitioner, as ``jax.nn``'s computation is. A causal ring gives the
    devices unequal work unless the tokens are striped: pass inputs in
    :func:`memwise.stripe`'s order with ``stripes=``.

    Args:
      query: ``(B, T, N, H)`` or ``(T, N, H)``.
      key: ``(B, S, K, H)`` or ``(S, K, H)``.
      value: ``(B, S, K, Hv)`` or ``(S, K, Hv)``.
      bias: optional float array broadcastable dim by dim to ``(B, N, T, S)`` (at most
        4 dims, leading ones added), added to the scores; it gets a gradient.
      mask: optional boolean array broadcastable to ``(B, N, T, S)``, True = attend.
        Float masks raise ``TypeError``: pass additive masks as ``bias``.
      scale: score scale (a float, or a traced scalar, which gets a gradient); default
        ``1 / sqrt(H)``.
      is_causal: query ``i`` sees keys ``j <= i`` (aligned at the top left, as
        ``jax.nn``).
      query_seq_lengths: int array ``(B,)``: queries at or past it return zeros.
      key_value_seq_lengths: int array ``(B,)``: keys at or past it are not seen.
      local_window_size: ``(left, right)`` or an int for both: query ``i`` sees keys
        ``i - left <= j <= i + right``.
      implementation: ``None`` (the default): a fused kernel where one is compiled for
        the platform and serves the call (on a TPU: splash attention's Pallas kernels,
        for causal, local windows, segment ids, soft cap, sinks and grouped-query K/V
        with lengths that are multiples of 128), memwise's XLA tiles elsewhere and
        for the rest; ``"xla"``: the XLA tiles; ``"pallas"``: the kernel (in Pallas's
        interpret mode off the TPU), and a ``ValueError`` naming the option it lacks.
        ``"cudnn"`` raises ``ValueError``: call ``jax.nn.dot_product_attention`` for
        cuDNN's fused kernel.
      return_residual: also return the per-row log-sum-exp of the scores, ``(B, T, N)``
        (``(T, N)`` unbatched) in the inputs' dtype, as ``jax.nn`` (including the sink
        when there are ``sinks``); as ``jax.nn``'s, it has no gradient unless
        ``differentiable_residual``.
      q_segment_ids: int array ``(B, T)`` (or ``(T,)``): a query sees only keys of its
        own segment (packed sequences); composes with the other masks.
      kv_segment_ids: int array ``(B, S)``; defaults to ``q_segment_ids`` when ``T == S``.
      logit_soft_cap: positive float ``c``: scores become ``c * tanh(s / c)`` (after
        ``scale``, before ``bias`` and masks), with their gradient.
      sinks: float array ``(N,)``: a learned logit per query head that joins the
        softmax denominator (its value contributes nothing), with its gradient. A query
        that sees no key then returns zeros.
      dropout_rate: drop each attention weight with this probability (Python float in
        ``[0, 1)``), scaling the kept ones by ``1 / (1 - rate)``; the mask is drawn per
        tile from ``dropout_rng`` in the forward and the same mask regenerated in the
        backward (nothing stored; it does not depend on ``chunk_size``).
      dropout_rng: a PRNG key, required when ``dropout_rate > 0``.
      dropout_broadcast: one dropout mask for every batch element and head (Flax's
        ``broadcast_dropout=True``); default a mask per batch element and head.
      differentiable_residual: give the residual its gradient (to combine partial
        attentions over key blocks, as ring and split-K attention do).
      stripes: ``None``, or the ``s`` of :func:`memwise.stripe` when every sequence
        axis (of query, key, value, mask, bias and the segment ids) is in its striped
        order (``mw.stripe(query, s, axis=1)``): causal masks, windows, lengths and
        dropout then use the positions before striping, so the result is the unstriped
        one in striped order (:func:`memwise.unstripe` it back). Split over ``s``
        devices along the sequence, every device then does the same causal work at
        every ring step. Needs ``T == S``, a multiple of ``s``; not in ``jax.nn``.
      chunk_size: tile ``(query rows, key cols)`` as for :func:`memwise.attention`,
        each tile holding every head; the backward runs the same tile (a
        :class:`memwise.tiling.Tiling` sets its own).

    Returns:
      The attention output, or ``(output, log-sum-exp)`` with ``return_residual``.

    A query whose keys a ``-inf`` bias hides returns the mean of all values (``jax.nn``:
    NaN, or with a mask hiding the rest, the mean of the values it hides); see the
    module's notes.

    Raises:
      TypeError: a non-array or wrong-dtype argument (float mask, integer query,
        float lengths), naming it.
      ValueError: shapes that do not match or broadcast, ``K`` not dividing ``N``, an
        unsupported ``implementation``, query, key and value of different dtypes (as
        ``jax.nn``).

    Example::

        >>> import jax, jax.numpy as jnp, memwise as mw
        >>> q = jax.random.normal(jax.random.key(0), (2, 128, 8, 16))
        >>> # 4 heads per K/V
        >>> kv = jax.random.normal(jax.random.key(1), (2, 128, 2, 16))
        >>> out = mw.dot_product_attention(q, kv, kv, is_causal=True)
        >>> ref = jax.nn.dot_product_attention(q, kv, kv, is_causal=True)
        >>> out.shape, bool(jnp.allclose(out, ref, atol=1e-5))
        ((2, 128, 8, 16), True)
    """
    check_options(
        implementation,
        {
            "is_causal": is_causal,
            "return_residual": return_residual,
            "differentiable_residual": differentiable_residual,
            "dropout_broadcast": dropout_broadcast,
        },
    )
    call = validate(
        query,
        key,
        value,
        bias,
        mask,
        scale=scale,
        is_causal=is_causal,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        logit_soft_cap=logit_soft_cap,
        sinks=sinks,
        dropout_rate=dropout_rate,
        dropout_rng=dropout_rng,
        dropout_broadcast=dropout_broadcast,
        stripes=stripes,
    )
    if 0 in call.shape[:4]:
        return _empty_result(call, chunk_size, return_residual)
    layout = _layout(call)
    operands, whole = _operands(call, layout)
    out, lse = _dispatch(
        call,
        layout,
        operands,
        whole,
        chunk_size=chunk_size,
        implementation=implementation,
        lse_unused=not (return_residual or call.sinks is not None or call.may_see_nothing),
    )
    return _corrections(
        call,
        layout,
        out,
        lse,
        return_residual=return_residual,
        differentiable_residual=differentiable_residual,
    )


def flax_attention_fn(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: jax.Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any = None,
    precision: Any = None,
    module: Any = None,
    is_causal: bool = False,
    *,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
) -> jax.Array:
    """:func:`dot_product_attention` with Flax's ``attention_fn`` convention.

    Pass it as ``attention_fn=`` to Flax linen ``nn.MultiHeadDotProductAttention`` or
    NNX ``nnx.MultiHeadAttention``: the arguments are ``flax.linen.dot_product_attention``'s
    (layout ``(batch, length, heads, head_dim)``, a ``(batch, heads, q_length,
    kv_length)``-broadcastable boolean ``mask``, dropout on the attention weights with
    ``broadcast_dropout`` sharing one mask over batch and heads), and the layer's own
    projections, masks and RNG streams are unchanged. The dropout mask differs from
    Flax's (memwise draws it per tile from the key), with the same distribution.

    Packed sequences: Flax's layers pass no segment ids to ``attention_fn``, so bind
    them: ``attention_fn=functools.partial(mw.flax_attention_fn, q_segment_ids=ids)``
    (``kv_segment_ids`` defaults to the same ids). In linen, build the layer inside the
    parent's ``@nn.compact`` call, where the ids are; in NNX, set the layer's
    ``attention_fn`` to the bound function before calling it. Segment ids are ``B x T``
    integers; the mask that would do their work is ``B x T x T`` booleans (64 MiB a
    sequence at ``T = 8,192``).

    Args:
      query: ``(B, T, N, H)`` (or ``(T, N, H)``).
      key: ``(B, S, K, H)``; ``K`` may be fewer heads than ``N`` (dividing it).
      value: ``(B, S, K, Hv)``.
      bias: optional float array added to the scores.
      mask: optional mask, True (or nonzero, as Flax's float masks) = attend.
      broadcast_dropout: one dropout mask for every batch element and head.
      dropout_rng: the dropout key (used when ``dropout_rate > 0`` and not
        ``deterministic``).
      dropout_rate: dropout probability of each attention weight.
      deterministic: no dropout.
      dtype: the computation dtype: q, k, v are cast to it (None: their own).
      precision: must be None (the tiles use the default matmul precision).
      module: must be None: with ``sow_weights`` Flax records the attention weights,
        which tiled attention never forms.
      is_causal: causal masking (NNX passes it), with the invisible tiles skipped.
      q_segment_ids: optional ``(B, T)`` integer ids of packed sequences: a query attends
        to the keys of its own segment only (bind with ``functools.partial``).
      kv_segment_ids: ``(B, S)`` ids of the keys (default: ``q_segment_ids``, which then
        needs ``S == T``).

    Returns:
      The attention output, ``query``'s shape (last dim ``value``'s).

    Raises:
      ValueError: ``precision`` or ``module`` set, or more than one batch dim.

    Example::

        >>> import flax.linen as nn, jax, jax.numpy as jnp, memwise as mw
        >>> layer = nn.MultiHeadDotProductAttention(
        ...     num_heads=4, qkv_features=32, attention_fn=mw.flax_attention_fn)
        >>> x = jnp.ones((2, 50, 16))
        >>> params = layer.init(jax.random.key(0), x)
        >>> layer.apply(params, x).shape
        (2, 50, 16)
    """
    if module is not None:
        raise ValueError(
            "sow_weights=True records the attention weights, which memwise's tiled "
            "attention never forms: use sow_weights=False with this attention_fn"
        )
    if precision is not None:
        raise ValueError(
            f"precision={precision!r} is not supported: memwise's tiles use the default "
            "matmul precision (float32 accumulation); pass precision=None"
        )
    arrays = [as_array(a, n) for a, n in ((query, "query"), (key, "key"), (value, "value"))]
    if arrays[0].ndim > 4:
        raise ValueError(
            f"query of shape {arrays[0].shape} has more than one batch dim: reshape the "
            "batch dims into one"
        )
    if dtype is not None:
        arrays = [a.astype(dtype) for a in arrays]
    if mask is not None:
        # Flax's masks are often float 0/1 (nn.make_causal_mask) and read as booleans.
        mask = as_array(mask, "mask")
        mask = mask if mask.dtype == jnp.bool_ else mask != 0
    rate = 0.0 if deterministic else dropout_rate
    out = dot_product_attention(
        arrays[0],
        arrays[1],
        arrays[2],
        bias=bias,
        mask=mask,
        is_causal=is_causal,
        dropout_rate=rate,
        dropout_rng=dropout_rng if rate else None,
        dropout_broadcast=bool(broadcast_dropout),
        q_segment_ids=q_segment_ids,
        kv_segment_ids=q_segment_ids if kv_segment_ids is None else kv_segment_ids,
    )
    assert isinstance(out, jax.Array)
    return out
