"""Memory-efficient softmax attention whose backward pass is tiled too.

``softmax(q k^T / sqrt(d) + bias, masked) v`` computed tile by tile with the online
softmax (Milakov & Gimelshein, arXiv:1805.02867; Rabe & Staats, *Self-attention does not
need O(n^2) memory*, arXiv:2112.05682) and differentiated with the FlashAttention
backward (Dao et al., NeurIPS 2022): the forward saves only the output and the per-row
log-sum-exp, the backward re-forms each tile's probabilities from them. It is the
``"softmax"`` reduction of :func:`memwise.engine.tiled_reduce`; no second loop lives
here. Memory both ways: q, k, v, the output and one ``chunk_size`` tile (per batch
element and head), never the L x L score matrix; a mask or bias shared over batch or
heads is sliced from its own shape and its gradient summed tile by tile, so it adds no
more than its own size (and its gradient's). With ``causal=True`` tiles above the
diagonal are never visited (the tile loop runs over the live ones), about half the work.

Low precision: as in fused attention kernels, scores, the running max and sum and the
output accumulator are float32 for bfloat16/float16 inputs, and the backward sums its
cotangents in float32 too; results are cast once at the end. Errors against a float64
reference are then those of the final rounding (measured: no worse than
``jax.nn.dot_product_attention``'s for the output and every gradient).

Many devices: queries (or batch/head dims) split over a mesh axis run as one
``shard_map`` through :mod:`memwise.sharding` (the same path as
``pairwise_reduce``); attention needs no communication in the forward pass, and the
backward all-reduces the gradients of k and v once when the queries are split.
On a ring (k and v split like the queries and passed around), a causal mask leaves the
first device idle for most steps; in the striped order of :func:`stripe` (Brandon et
al., *Striped Attention*, arXiv:2311.09431) every device holds every D-th token and does
the same visible work at every step.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from memwise._arguments import as_array
from memwise._attention_args import attention_sharding, check_scale
from memwise._attention_tiles import Visibility, attend, check_stripes, stripe_count
from memwise.engine import Ring
from memwise.engine.kernels import check_implementation
from memwise.sharding import (
    devices,
    ring_step,
    sharded_call,
    use_ring,
)
from memwise.tiling import ChunkSize, tiling

__all__ = ["attention", "stripe", "unstripe"]


def _full_rank(arr: jax.Array, name: str, batch: tuple, lq: int, lk: int) -> jax.Array:
    """Check that a mask/bias broadcasts to ``batch + (lq, lk)`` without enlarging it, and
    give it that rank by adding leading singleton dims (no copy). Its size-1 dims stay:
    the engine slices it from its own shape and broadcasts each tile."""
    try:
        full = jnp.broadcast_shapes(arr.shape, batch + (lq, lk))
    except ValueError as e:
        raise ValueError(
            f"{name} of shape {arr.shape} does not broadcast to (..., Lq, Lk) = {batch + (lq, lk)}"
        ) from e
    if full != batch + (lq, lk):
        raise ValueError(f"{name} of shape {arr.shape} would enlarge the output shape")
    return arr.reshape((1,) * (len(full) - arr.ndim) + arr.shape)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mask: jax.Array | None = None,
    bias: jax.Array | None = None,
    causal: bool = False,
    scale: float | jax.Array | None = None,
    chunk_size: ChunkSize = "auto",
    mesh: jax.sharding.Mesh | None = None,
    axis_name: str | tuple[str, ...] | None = None,
    shard_dim: int = -2,
    ring: bool | None = None,
    stripes: int | None = None,
    implementation: str | None = None,
) -> jax.Array:
    """Softmax attention ``softmax(q k^T * scale + bias) v`` in tiles, forward and backward.

    Shapes: ``q (..., Lq, d)``, ``k (..., Lk, d)``, ``v (..., Lk, dv)`` with equal leading
    (batch, heads, ...) dims; returns ``(..., Lq, dv)`` in their dtype. ``mask`` (bool,
    True = attend) and ``bias`` broadcast to ``(..., Lq, Lk)``; they are sliced tile by
    tile from their own shape (a ``(B, 1, 1, Lk)`` key-padding mask or an ``(Lq, Lk)``
    bias is never expanded over batch, heads or queries). ``causal=True`` lets query
    ``i`` see keys ``j <= i`` and skips the tiles above the diagonal. A query that sees
    no key returns zeros (so does every query when ``Lk = 0``; ``Lq = 0`` gives an empty
    output). Gradients: q, k, v, ``bias`` and a traced ``scale``.

    Memory: O(L d) per head plus one ``(rows, cols)`` tile of scores, in both passes
    (the L x L matrix is never formed); a mask or bias adds at most its own size, and
    the bias gradient its own. Compute: the backward re-forms each tile's probabilities
    from the saved per-row log-sum-exp, about 2.5 forward passes. bfloat16/float16
    inputs are computed with float32 scores and accumulators (an extra float32 copy of
    the output is kept for the backward).

    Args:
      q: queries, ``(..., Lq, d)``.
      k: keys, ``(..., Lk, d)``.
      v: values, ``(..., Lk, dv)``.
      mask: optional boolean array broadcastable to ``(..., Lq, Lk)``. Other dtypes
        raise ``TypeError``: pass additive (0 / -inf) masks as ``bias``.
      bias: optional float array broadcastable to ``(..., Lq, Lk)``, added to the scores
        (in float32 for low-precision inputs).
      causal: mask keys after the query position.
      scale: score scale, a float or a scalar array (traced, e.g. a learned temperature:
        it gets a gradient); default ``1 / sqrt(d)``.
      chunk_size: tile ``(query rows, key cols)``, an int, ``"auto"``, or a
        :class:`memwise.tiling.Tiling` (which also sets the backward tile).
      mesh: run on many devices (``shard_map``), dim ``shard_dim`` of ``q`` split over
        mesh axis ``axis_name`` (as for :func:`memwise.pairwise_reduce`). With a
        batch/head dim split, k, v, mask and bias are split the same way and nothing is
        communicated. With the queries split (``shard_dim=-2``, the default) k and v are
        split too and passed around the devices (ring attention, see ``ring``). Without
        ``mesh`` and ``axis_name`` the split follows the data, eagerly and under
        ``jit``: ``q``'s ``NamedSharding`` or Explicit-axes type (any of its
        batch/head/query dims), or, on a mesh with Auto axes, dim ``shard_dim`` over all
        its devices.
      axis_name: the axis (or axes) of ``mesh`` that splits dim ``shard_dim`` of ``q``.
      shard_dim: the dim of ``q`` that ``axis_name`` splits: ``-2`` (queries) or a
        leading batch/head dim.
      ring: with the queries split, whether k and v are split over the same devices
        and passed around them (Liu, Zaharia, Abbeel, *Ring Attention with Blockwise
        Transformers*, 2023): every device then holds 1/D of q, k and v; each block is
        reduced while the next is in flight, and in the backward the gradients of k and
        v travel with their block back to its owner. ``mask`` and ``bias`` are split
        like the queries and read at the columns of the block each step holds (their
        rows on each device, every column). ``False``: k and v whole on every device
        (one all-gather when they arrive split), their gradients all-reduced once.
        ``None`` (the default): the cost model chooses
        (:func:`memwise.sharding.ring_pays`: a ring when holding k and v whole would add
        more bytes than the device's block of q, so from two devices on when Lk is
        Lq), and :func:`memwise.fit` may set it under a budget (a ``ring`` knob); never
        a ring when Lk does not divide evenly.
        ``True``: a ring, or a ``ValueError``.
      stripes: ``None``, or the ``s`` of :func:`stripe` when q, k, v (and ``mask``,
        ``bias``, both axes) are in its striped order: ``causal`` then compares the
        positions before striping, so the result is the unstriped one, striped. With
        ``s`` the number of devices of a causal ring, every device does the same number
        of visible tiles at every ring step (contiguous, device ``i`` does ``i + 1``
        blocks' worth while the others wait). Needs ``Lq == Lk``, divisible by ``s``.
      implementation: ``None`` (the default): a fused kernel where one is compiled for
        the platform and serves the call (on a TPU: splash attention's Pallas kernels,
        with or without ``causal``, lengths multiples of 128, no mask or bias, on one
        device), the XLA tiles elsewhere; ``"xla"``: the XLA tiles; ``"pallas"``: the
        kernel (in Pallas's interpret mode off the TPU), or a ``ValueError`` naming
        the option it lacks.

    Example::

        >>> import jax, jax.numpy as jnp, memwise as mw
        >>> q = k = v = jnp.ones((2, 4, 100, 16))     # batch, heads, length, dim
        >>> mw.attention(q, k, v, causal=True, chunk_size=(32, 64)).shape
        (2, 4, 100, 16)
    """
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(
            f"causal must be a Python bool (it decides which tiles run), got "
            f"{causal!r}; under jit pass it as a static argument"
        )
    q, k, v = (as_array(a, name) for a, name in ((q, "q"), (k, "k"), (v, "v")))
    if q.ndim < 2 or k.ndim < 2 or v.ndim < 2:
        raise ValueError(f"q, k, v need shape (..., L, d); got {q.shape}, {k.shape}, {v.shape}")
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
    dtype = jnp.result_type(q, k, v)
    scale = check_scale(scale, d)
    check_implementation(implementation)
    striped = check_stripes(stripes, lq, lk)
    if mask is not None:
        mask = as_array(mask, "mask")
        if mask.dtype != jnp.bool_:
            raise TypeError(
                f"mask must be a boolean array (True = attend), got dtype {mask.dtype}; "
                "pass additive masks (0 / -inf) as bias= instead"
            )
        mask = _full_rank(mask, "mask", batch, lq, lk)
    if bias is not None:
        bias = as_array(bias, "bias")
        if bias.dtype == jnp.bool_:
            raise TypeError(
                "bias must be a float array added to the scores, got a boolean "
                "array; pass boolean masks as mask="
            )
        if jnp.issubdtype(bias.dtype, jnp.complexfloating):
            raise TypeError(
                f"bias must be a real array added to the scores, got dtype {bias.dtype}; "
                "pass its real part (jnp.real(bias)) if that is what is meant"
            )
        if not jnp.issubdtype(bias.dtype, jnp.floating):  # integers add exactly
            bias = bias.astype(dtype)
        bias = _full_rank(bias, "bias", batch, lq, lk)
    if lq == 0 or lk == 0 or 0 in batch:
        if chunk_size != "auto":  # still a valid size ("auto" is a knob: not resolved here)
            tiling(1, 1, chunk_size)
        # What the dense computation returns: no queries (or no batch element), or
        # queries that see no key (zeros, as for a fully masked query). Gradients are
        # zeros.
        return jnp.zeros(batch + (lq,) + v.shape[-1:], dtype)

    sharding = attention_sharding(q, mesh, axis_name, shard_dim)
    if sharding is None:
        if ring:
            raise ValueError(
                "ring=True needs the queries split over devices: pass mesh= "
                "(and axis_name=), shard q, or call under jax.set_mesh"
            )
        return _attention_local(
            q,
            k,
            v,
            mask,
            bias,
            scale,
            causal,
            chunk_size,
            None,
            None,
            striped,
            implementation=implementation,
        )
    mesh, spec = sharding
    row_axes = spec[-2]
    ringed = auto_shape = None
    if row_axes is not None:
        n_devices = devices(mesh, row_axes)
        if use_ring(ring, (k, v), lk, mesh, row_axes, "k", beside=q, dim=-2):
            ringed = Ring(row_axes, n_devices)
        auto_shape = ring_step(lq, lk, n_devices, (q, k, v))
    elif ring:
        raise ValueError("ring=True needs the queries split over devices (shard_dim=-2)")

    def pair_spec(arr):
        # A dim the mask/bias broadcasts over (size 1) stays replicated.
        return P(*[a if n != 1 else None for a, n in zip(spec, arr.shape[:-1])], None)

    def local(q, k, v, mask, bias, scale):
        offset = None
        if row_axes is not None:
            # Causal masking compares global positions: this device's first query.
            offset = lax.axis_index(row_axes).astype(jnp.int32) * q.shape[-2]
        return _attention_local(
            q,
            k,
            v,
            mask,
            bias,
            scale,
            causal,
            chunk_size,
            offset,
            ringed,
            striped,
            auto_shape,
            implementation=implementation,
        )

    kv_spec = P(*spec[:-2], row_axes if ringed else None, None)
    in_specs = (
        P(*spec),
        kv_spec,
        kv_spec,
        P() if mask is None else pair_spec(mask),
        P() if bias is None else pair_spec(bias),
        P(),
    )
    return sharded_call(local, mesh, in_specs, P(*spec), q, k, v, mask, bias, scale)


def _regroup(x: Any, stripes: Any, axis: Any, name: str, *, inverse: bool) -> jax.Array:
    """``x`` with axis ``axis`` read as ``(n, s)`` groups written as ``(s, n)`` (striping;
    the reverse with ``inverse``), after the checks that name ``name``."""
    x = as_array(x, "x")
    stripes = stripe_count(stripes, f"{name}: ")
    if (
        isinstance(axis, bool)
        or not isinstance(axis, (int, np.integer))
        or not -x.ndim <= axis < x.ndim
    ):
        raise ValueError(f"{name}: axis={axis!r} is not an axis of x with shape {x.shape}")
    axis = int(axis) % x.ndim
    length = x.shape[axis]
    if length == 1:  # a mask or bias that broadcasts over the axis
        return x
    if length % stripes:
        raise ValueError(
            f"{name}: axis {axis} of x has length {length}, not divisible by "
            f"stripes={stripes}; pad the sequence to a multiple of {stripes}"
        )
    groups = (stripes, length // stripes) if inverse else (length // stripes, stripes)
    y = x.reshape(x.shape[:axis] + groups + x.shape[axis + 1 :])
    return jnp.swapaxes(y, axis, axis + 1).reshape(x.shape)


def stripe(x: jax.Array, stripes: int, axis: int = -2) -> jax.Array:
    """``x`` with its sequence axis in striped order: stripe ``d`` holds positions
    ``d, d + s, d + 2s, ...`` and the stripes follow each other.

    Split contiguously over ``s`` devices (a ring of :func:`attention`), device ``d``
    then holds every ``s``-th token, so a causal mask gives every device the same work
    at every ring step (Brandon et al., *Striped Attention*, arXiv:2311.09431). Stripe
    the inputs once (q, k, v; a mask or bias along both sequence axes), run
    ``attention(..., stripes=s)`` as often as needed, and :func:`unstripe` the output.
    Position-wise layers in between do not care about the order.

    Args:
      x: an array whose axis ``axis`` (default ``-2``, attention's sequence axis) has a
        length divisible by ``stripes``, or 1 (a mask or bias that broadcasts over it
        is returned as it is).
      stripes: the number of stripes, the ring's device count.
      axis: the sequence axis.

    Returns:
      ``x`` permuted along ``axis``.

    Example::

        >>> import jax.numpy as jnp, memwise as mw
        >>> mw.stripe(jnp.arange(6.0)[:, None], 2)[:, 0]
        Array([0., 2., 4., 1., 3., 5.], dtype=float32)
    """
    return _regroup(x, stripes, axis, "stripe", inverse=False)


def unstripe(x: jax.Array, stripes: int, axis: int = -2) -> jax.Array:
    """The inverse of :func:`stripe`: the sequence axis back in position order.

    Args:
      x: an array in :func:`stripe`'s order along ``axis``.
      stripes: the ``stripes`` it was striped with.
      axis: the sequence axis.

    Returns:
      ``x`` permuted back along ``axis``.

    Example::

        >>> import jax.numpy as jnp, memwise as mw
        >>> x = jnp.arange(12.0).reshape(6, 2)
        >>> bool((mw.unstripe(mw.stripe(x, 3), 3) == x).all())
        True
    """
    return _regroup(x, stripes, axis, "unstripe", inverse=True)


def _attention_local(
    q,
    k,
    v,
    mask,
    bias,
    scale,
    causal,
    chunk_size,
    row_offset,
    ring=None,
    stripes=None,
    auto_shape=None,
    *,
    implementation=None,
):
    """Attention on one device (or per device inside shard_map); ``row_offset`` is the
    global index of the first query (None: 0); with a ``ring``, k and v are this
    device's block; ``stripes``: ``(s, Lq, Lk)`` of a striped order (or None);
    ``auto_shape``: see :func:`memwise.tiling.tiling`."""
    out, _ = attend(
        q,
        k,
        v,
        scale=scale,
        visibility=Visibility(causal=bool(causal)),
        chunk_size=chunk_size,
        mask=mask,
        bias=bias,
        row_offset=row_offset,
        ring=ring,
        stripes=stripes,
        auto_shape=auto_shape,
        implementation=implementation,
        lse_unused=True,
    )
    return out.astype(jnp.result_type(q, k, v))
