"""``pairwise_reduce``: reduce ``fn(x_i, y_j)`` over one side without an n x m array.

The user-facing pairwise reduction (sum, logsumexp, max/min and their arg-extremes) of
any JAX function of two points, on the one tile engine (:mod:`memwise.engine`): memory
in both directions is inputs + outputs + one tile, because the gradient of a reduction
is a reduction of the same shape (KeOps: Charlier, Feydy, Glaunes, Collin, Durif, JMLR
22, 2021) and ``logsumexp`` re-forms each tile's weights from the saved per-row result
(the FlashAttention backward). This is what the point-cloud gradient in OTT-JAX issue
417 needed: its forward pass was chunked, its gradient materialised the cost matrix.

Tiles are resolved once (:mod:`memwise.tiling`); with the points of one side split over
devices every device tiles its own rows (:mod:`memwise.sharding`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NoReturn

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from memwise._arguments import check_arrays
from memwise.engine import REDUCTIONS, Ring, tiled_reduce
from memwise.engine.kernels import Pattern, check_implementation, may_serve
from memwise.sharding import (
    check_divisible,
    convert,
    declared_split,
    devices,
    first_items,
    has_explicit_axes,
    ring_step,
    row_sharding,
    sharded_call,
    use_ring,
    varying_over,
)
from memwise.tiling import ChunkSize, Tiling, leading_length, pair_bytes, tiling

__all__ = ["pairwise_reduce"]


@dataclasses.dataclass(frozen=True)
class _Kind:
    """One of ``pairwise_reduce``'s reductions as the engine computes it: the engine's
    reduction, the sign of the scores (a min is ``-max(-s)``), whether the result is
    the index (the arg-extremes: no derivative), and how weights enter (``"times"``
    for a sum, ``"plus"``, log-weights, for a log-sum-exp; ``None``: not supported)."""

    engine: str
    sign: float = 1.0
    index: bool = False
    weights: str | None = None


_KINDS = {
    "sum": _Kind("sum", weights="times"),
    "logsumexp": _Kind("logsumexp", weights="plus"),
    "max": _Kind("max"),
    "min": _Kind("max", sign=-1.0),
    "argmax": _Kind("max", index=True),
    "argmin": _Kind("max", sign=-1.0, index=True),
}
_PAIRWISE = tuple(_KINDS)
_KERNEL_REDUCTIONS = ("sum", "logsumexp")  # a user's fn in the TPU kernel


def pairwise_reduce(
    fn: Callable,
    x: Any,
    y: Any,
    *,
    reduce: str = "sum",
    weights: jax.Array | None = None,
    chunk_size: ChunkSize = "auto",
    axis: int = 1,
    mesh: jax.sharding.Mesh | None = None,
    axis_name: str | tuple[str, ...] | None = None,
    ring: bool | None = None,
    implementation: str | None = None,
) -> jax.Array:
    """``reduce_j fn(x_i, y_j) [* or + weights_j]`` without ever holding an n x m array.

    For every row ``i`` (``axis=1``; ``axis=0`` reduces over rows instead, giving one
    result per column) the values ``fn(x_i, y_j)`` are reduced over ``j``, tile by
    tile. ``fn`` is any JAX function of two points (pytrees allowed; ``x`` and ``y`` are
    pytrees whose leaves share a leading axis of n and m points) returning a scalar or
    an array. ``weights`` (shape ``(m,) + w``, broadcast against ``fn``'s output)
    multiply the values for ``"sum"`` (``K @ w`` for a kernel ``fn``) and are added as
    log-weights for ``"logsumexp"``. ``"max"``/``"min"`` return the extreme value (gradient
    flows to the arg-extreme pair: a subgradient), ``"argmax"``/``"argmin"`` its index
    (int32, no gradient); as with ``jnp.max``/``jnp.argmax``, a NaN value propagates and
    its first index wins. Sums and log-sum-exps accumulate in at least float32 and
    return ``fn``'s dtype, as ``jnp.sum`` does.

    Empty inputs give the dense result: no kept points, an empty array; nothing to
    reduce over, the reduction's identity (``"sum"``: 0, ``"logsumexp"``: -inf), or a
    ``ValueError`` for the max/min family, which has none (as ``jnp.max``).

    Memory, forward and backward: inputs + outputs + one ``chunk_size`` tile of ``fn``'s
    intermediates. The backward is one more tiled pass that re-evaluates ``fn`` under
    ``jax.vjp`` (KeOps: the gradient of a reduction is a reduction); ``logsumexp``
    re-forms each tile's probabilities from the saved per-row result. Compute: the
    gradient costs about 2-3 forward passes. Gradients reach ``x``, ``y``, ``weights``
    and every array ``fn`` closes over.

    Args:
      fn: ``fn(x_i, y_j) -> scalar or array``.
      x: pytree of arrays, leading axis n.
      y: pytree of arrays, leading axis m.
      reduce: ``"sum"``, ``"logsumexp"``, ``"max"``, ``"min"``, ``"argmax"``, ``"argmin"``.
      weights: optional ``(m,) + w`` array (``(n,) + w`` when ``axis=0``).
      chunk_size: tile ``(rows, cols)``, an int for square tiles, ``"auto"``
        (:func:`memwise.knobs.auto`; default tile ~8 MiB of intermediates), or a
        :class:`memwise.tiling.Tiling` that also sets the backward pass's tile (by
        default the forward tile with half the rows).
      axis: 1 to reduce over ``y`` (one result per x), 0 to reduce over ``x``.
      mesh: run on many devices with the points of ``x`` split over mesh axis
        ``axis_name`` (``shard_map``): each device tiles its own rows, forward and
        backward. Without ``mesh`` and ``axis_name`` the split follows the data, eagerly
        and under ``jit``: a ``NamedSharding`` of ``x`` (else ``y``) over its first
        axis, a type split over Explicit mesh axes, or, on a mesh with Auto axes (the
        arrays' own, or one set with ``jax.set_mesh``), the points split over all of its
        devices when they divide evenly. When only ``y``'s points are split, each device
        reduces its own columns and the partial results are combined (``psum``;
        ``all_gather`` for max/min and their arg-extremes, as global indices).
      axis_name: the axis (or axes) of ``mesh`` that splits the points of ``x``.
      ring: with ``x``'s points split, whether ``y`` is split over the same devices too
        and passed around them (``ppermute``, each block reduced while the next is in
        flight; in the backward each block's gradient travels with it back to its
        owner), so that every device holds about 1/D of both operands. ``False``:
        ``y`` whole on every device (one all-gather when it arrives split), its gradient
        all-reduced once (one transfer, not D - 1 steps). ``None`` (the default): the
        cost model chooses (:func:`memwise.sharding.ring_pays`: a ring when holding
        ``y`` whole would add more bytes than the device's block of ``x``, so clouds of
        equal size on two devices hold it whole), and :func:`memwise.fit` may set it
        under a budget (a ``ring`` knob); never a ring when m does not divide evenly over the
        devices or ``y`` is declared whole on every device (a replicated
        ``NamedSharding``). ``True``: a ring, or a ``ValueError``.
      implementation: ``None`` (the default): on a TPU, ``"sum"`` and ``"logsumexp"``
        run in a fused Pallas kernel where it serves the call
        (:mod:`memwise.engine.tpu_pair_function`: ``fn`` traced once and evaluated per
        feature over tiles of pairs; points one ``(n,)`` or ``(n, d)`` array a side, at
        most 32 features, a scalar per pair, elementwise operations, sums, slices and
        broadcasts of the features), the XLA tiles otherwise and on other platforms.
        ``"xla"``: the tiles everywhere. ``"pallas"``: the kernel (in Pallas's interpret
        mode where no TPU is present), or a ``ValueError`` naming what it does not serve.
        The kernel computes ``fn`` in float32 and ignores ``chunk_size`` (its blocks are
        its own).

    Returns:
      Array of shape ``(n,) + out`` (``(m,) + out`` for ``axis=0``).

    Example::

        >>> import jax, jax.numpy as jnp, memwise as mw
        >>> x, y = jnp.ones((5, 2)), jnp.zeros((7, 2))
        >>> cost = lambda a, b: jnp.sum((a - b) ** 2)
        >>> mw.pairwise_reduce(lambda a, b: -cost(a, b), x, y, reduce="logsumexp",
        ...                    chunk_size=(2, 3)).shape
        (5,)
    """
    return reduce_pairs(
        fn,
        x,
        y,
        reduce=reduce,
        weights=weights,
        chunk_size=chunk_size,
        axis=axis,
        mesh=mesh,
        axis_name=axis_name,
        ring=ring,
        implementation=implementation,
    )


def reduce_pairs(
    fn: Callable,
    x: Any,
    y: Any,
    *,
    reduce: str = "sum",
    weights: jax.Array | None = None,
    chunk_size: ChunkSize = "auto",
    axis: int = 1,
    mesh: jax.sharding.Mesh | None = None,
    axis_name: str | tuple[str, ...] | None = None,
    ring: bool | None = None,
    pattern: Pattern | None = None,
    implementation: str | None = None,
) -> jax.Array:
    """:func:`pairwise_reduce`, for memwise's own callers that know what ``fn``
    computes: ``pattern`` names it for the engine's backend seam
    (:mod:`memwise.engine.kernels`), so a fused kernel registered for it may serve each
    device's reduction, as ``implementation`` (``None``, ``"xla"``, ``"pallas"``) asks."""
    # Type checks first: ``in`` on a NumPy array asks for its truth value.
    if not isinstance(reduce, str) or reduce not in _PAIRWISE:
        raise ValueError(f"reduce must be one of {_PAIRWISE}, got {reduce!r}")
    if not isinstance(axis, (int, np.integer)) or axis not in (0, 1, -1, -2):
        raise ValueError(f"axis must be 1 (reduce over y) or 0 (reduce over x), got {axis!r}")
    if not callable(fn):
        raise TypeError(f"fn must be a callable of two points, got {type(fn).__name__}")
    check_implementation(implementation)
    if implementation == "pallas" and pattern is None and reduce not in _KERNEL_REDUCTIONS:
        raise ValueError(
            f"implementation='pallas' serves reduce='sum' and 'logsumexp', not {reduce!r}: "
            "pass implementation=None or 'xla'"
        )
    check_arrays(x, "x")
    check_arrays(y, "y")
    if weights is not None:
        check_arrays(weights, "weights")
        try:
            weights = jnp.asarray(weights)
        except (TypeError, ValueError) as error:  # a dict, a ragged list
            raise TypeError(
                f"weights must be one array of shape (m,) + trailing, got "
                f"{type(weights).__name__} ({error}); pass a JAX or NumPy array"
            ) from None
    # Which sides are split over devices: mesh= always means x; else each side's own.
    x_shard = row_sharding(x, mesh, axis_name, "x")
    if mesh is None:
        y_shard = row_sharding(y, None, None, "y")
    else:  # y's points split over the same axis: say so, for axis=0 to keep them split
        declared = declared_split(y)
        same = declared is not None and x_shard is not None and declared[1] == x_shard[1]
        y_shard = x_shard if same else None
    if axis in (0, -2):
        x_shard, y_shard = y_shard, x_shard
        x, y = y, x  # reduce over the points of x: the engine always reduces columns
        fn = _swapped(fn)
        chunk_size = _transposed(chunk_size)
    reduced, kept = ("x", "y") if axis in (0, -2) else ("y", "x")
    n = leading_length(x, kept)
    m = leading_length(y, reduced)
    x = jax.tree.map(jnp.asarray, x)
    y = jax.tree.map(jnp.asarray, y)
    kind = _KINDS[reduce]
    if weights is not None:
        if kind.weights is None:
            raise ValueError(f"weights are not supported with reduce={reduce!r}; fold them into fn")
        if weights.ndim < 1 or weights.shape[0] != m:
            raise ValueError(
                f"weights must have shape ({m},) + trailing (one per point of {reduced}), "
                f"got {weights.shape}"
            )
    try:
        out0 = jax.eval_shape(fn, first_items(x), first_items(y))
    except Exception as e:
        raise ValueError(
            "fn(x[i], y[j]) failed on one pair of points; check that the trailing shapes "
            f"of {kept} {[np.shape(a)[1:] for a in jax.tree.leaves(x)]} and {reduced} "
            f"{[np.shape(a)[1:] for a in jax.tree.leaves(y)]} are what fn expects: {e}"
        ) from e
    if not isinstance(out0, jax.ShapeDtypeStruct):
        raise TypeError(f"fn must return one array (a scalar per pair), got {out0}")
    if kind.engine != "sum" and not jnp.issubdtype(out0.dtype, jnp.floating):
        raise TypeError(f"reduce={reduce!r} needs a real float fn, but fn returns {out0.dtype}")
    w_trailing = () if weights is None else weights.shape[1:]
    try:
        out_shape = jnp.broadcast_shapes(out0.shape, w_trailing)
    except ValueError as e:
        raise ValueError(
            f"weights' trailing shape {w_trailing} does not broadcast with fn's output "
            f"shape {out0.shape}"
        ) from e
    out_ndim = len(out_shape)
    if n == 0 or m == 0:
        return _empty_result(reduce, n, out_shape, out0.dtype, weights, reduced, chunk_size)

    row_shard, col_shard = x_shard, y_shard
    if row_shard is None and col_shard is None:
        if ring:
            raise ValueError(
                "ring=True needs the points split over devices: pass mesh= (and "
                "axis_name=), shard x, or call under jax.set_mesh"
            )
        out = _pairwise_local(
            fn, x, y, weights, kind, chunk_size, out_ndim, seam=(pattern, implementation)
        )
        return _user_result(out, kind)
    ringed = None
    if row_shard is not None:
        # The kept points split: the reduced ones on a ring, or replicated.
        mesh, axes = row_shard
        check_divisible(n, mesh, axes, kept)
        if use_ring(ring, y, m, mesh, axes, reduced, beside=x):
            ringed = Ring(axes, devices(mesh, axes))
    else:
        assert col_shard is not None  # both None was handled above
        mesh, axes = col_shard
        check_divisible(m, mesh, axes, reduced)
        # Split the kept points too, and pass the reduced ones around a ring; not on
        # Explicit axes, where the kept points' type says they are whole (and so must
        # the result be).
        if not has_explicit_axes(mesh) and use_ring(ring, x, n, mesh, axes, kept, beside=y):
            row_shard, ringed = col_shard, Ring(axes, devices(mesh, axes))

    # fn is traced inside the shard_map: a jaxpr traced outside would carry the
    # caller's mesh context into the per-device program. The arrays it closes over
    # enter as replicated values; their gradients are all-reduced once by the
    # shard_map's transpose.
    auto_shape = ring_step(n, m, devices(mesh, axes), (x, y, weights))

    def local(x_l, y_l, w_l):
        out = _pairwise_local(
            fn,
            x_l,
            y_l,
            w_l,
            kind,
            chunk_size,
            out_ndim,
            ringed,
            auto_shape,
            seam=(pattern, implementation),
        )
        if row_shard is None:  # each device reduced its own columns
            m_local = leading_length(y_l, reduced)
            out = REDUCTIONS[kind.engine].combine_over_devices(out, axes, m_local)
        return _user_result(out, kind)

    if row_shard is not None:
        y_spec = P(axes) if ringed else P()
        in_specs, out_specs = (P(axes), y_spec, y_spec), P(axes)
    else:
        in_specs, out_specs = (P(), P(axes), P(axes)), P()
    return sharded_call(local, mesh, in_specs, out_specs, x, y, weights)


def _empty_result(reduce, n, out_shape, dtype, weights, reduced, chunk_size):
    """The dense result of a pairwise reduction with no kept points (``n = 0``) or
    nothing to reduce over (``m = 0``); gradients are zeros."""
    if chunk_size != "auto":  # still a valid size ("auto" is a knob: not resolved here)
        tiling(1, 1, chunk_size)
    kind = _KINDS[reduce]
    if kind.index:
        return jnp.zeros((n,) + out_shape, jnp.int32) if n == 0 else _no_identity(reduce, reduced)
    if weights is not None:
        dtype = jnp.result_type(dtype, weights.dtype)
    value = REDUCTIONS[kind.engine].empty(n, out_shape, dtype)
    return _no_identity(reduce, reduced) if value is None else value


def _no_identity(reduce: str, reduced: str) -> NoReturn:
    raise ValueError(
        f"reduce={reduce!r} over zero points of {reduced} has no value (as jnp.max of an "
        "empty array); pass at least one point, or use 'sum' or 'logsumexp'"
    )


def _pairwise_local(
    fn, x, y, weights, kind, chunk_size, out_ndim, ring=None, auto_shape=None, seam=(None, None)
):
    """pairwise_reduce on one device (or per device inside shard_map, ``y`` and the
    weights this device's block of a ``ring``), as the engine's result: for a max,
    ``(signed extreme, index or None)``. ``auto_shape``: see :func:`memwise.tiling.tiling`;
    ``seam``: :func:`reduce_pairs`'s ``(pattern, implementation)``."""
    if kind.index and ring is None and varying_over(x, y):
        reduce = [name for name, k in _KINDS.items() if k == kind][0]
        raise NotImplementedError(
            f"reduce={reduce!r} with the reduced points split over devices is not supported; "
            "shard the kept points instead (axis=1: rows of x)"
        )
    data = (x, y, weights)
    converted, consts, (x, y, weights), vary_consts = convert(
        fn, data, lambda d: (first_items(d[0]), first_items(d[1]))
    )
    cols: dict = {"y": y}
    if weights is not None:
        cols["w"] = weights
    pattern, implementation = seam
    if (
        pattern is None
        and kind.engine in _KERNEL_REDUCTIONS
        and may_serve("pair_function", kind.engine, implementation)
    ):
        pattern = Pattern("pair_function", (("fn", converted), ("weights", kind.weights)))

    def tile_fn(xb, cb, _pairs, k, _rids, _cids):
        s = jax.vmap(jax.vmap(lambda a, b: converted(a, b, *k), (None, 0)), (0, None))(xb, cb["y"])
        s = s.reshape(s.shape[:2] + (1,) * (out_ndim - (s.ndim - 2)) + s.shape[2:])
        if "w" in cb:
            w = cb["w"]
            w = w.reshape((1, w.shape[0]) + (1,) * (out_ndim - (w.ndim - 1)) + w.shape[1:])
            s = s * w if kind.weights == "times" else s + w
        return -s if kind.sign < 0 else s

    tiles = tiling(
        leading_length(x, "x"),
        leading_length(y, "y"),
        chunk_size,
        pair_bytes=lambda: pair_bytes(converted, first_items(x), first_items(y), *consts),
        auto_shape=auto_shape,
    )
    if kind.index:  # an index: no derivative, in either mode
        x, cols, consts = lax.stop_gradient((x, cols, consts))
    out = tiled_reduce(
        tile_fn,
        x,
        cols,
        reduce=kind.engine,
        tiles=tiles,
        consts=consts,
        vary_consts=vary_consts,
        ring=ring,
        forward_mode_error=_FORWARD_MODE,
        pattern=pattern,
        implementation=implementation,
    )
    if kind.engine != "max":
        return out
    value, arg = out
    if kind.index:
        # The value too: combining over devices compares each device's extreme.
        return lax.stop_gradient(value), lax.stop_gradient(arg)
    return value, None


_FORWARD_MODE = (
    "memwise.pairwise_reduce supports reverse mode (grad, vjp, jacrev; also jax.hessian "
    "and jacfwd of grad) and vmap, but not forward mode through it (jvp, jacfwd, "
    "jax.linearize); for forward mode compute the dense reduction (jax.vmap of fn over "
    "both point sets, then the reduction), or differentiate in reverse mode"
)


def _user_result(out: Any, kind: _Kind) -> Any:
    """The result a user sees from the engine's: for a max, the value with its sign
    restored, or for the arg-extremes the index without its value."""
    if kind.engine != "max":
        return out
    value, arg = out
    if kind.index:
        return arg
    return -value if kind.sign < 0 else value


def _swapped(fn: Callable) -> Callable:
    return lambda b, a: fn(a, b)


def _transposed(chunk_size: ChunkSize) -> ChunkSize:
    if isinstance(chunk_size, Tiling):
        return chunk_size.transposed()
    if isinstance(chunk_size, (tuple, list)) and len(chunk_size) == 2:
        return (chunk_size[1], chunk_size[0])
    return chunk_size
