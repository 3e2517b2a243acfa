"""The engine's entry point: :func:`tiled_reduce` and its tiled custom VJP.

It checks the operands' layout once, resolves the static :class:`TileSpec`, guards
forward mode with the caller's message, and runs the forward (:mod:`.forward`) and
backward (:mod:`.backward`) passes on one device, or their ring form (:mod:`.ring`)
with the columns split over devices.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from memwise._vjp import Static, custom_vjp, guard_forward_mode, unwrap
from memwise.engine import kernels
from memwise.engine.backward import backward
from memwise.engine.forward import tiled_forward
from memwise.engine.reductions import REDUCTIONS
from memwise.engine.ring import Ring, ring_core, ring_spec
from memwise.engine.tiles import FORWARD_MODE, Leaves, TileSpec
from memwise.tiling import Tiling, leading_length

__all__ = ["tiled_reduce"]


@functools.partial(
    custom_vjp, nondiff_argnums=(0,), forward_mode_error=lambda spec: spec.forward_mode_error
)
def _tiled_core(spec: TileSpec, rows: Leaves, cols: Leaves, pairs: Leaves, consts: Leaves) -> Any:
    return tiled_forward(spec, rows, cols, pairs, consts)[0]


def _tiled_core_fwd(spec, *primals):
    values, flags = zip(*(unwrap(p) for p in primals))
    out, residual = tiled_forward(spec, *values)
    return out, (values, residual, Static(flags))


def _tiled_core_bwd(spec, res, ct):
    values, residual, flags = res
    return backward(spec, values, residual, flags.value, ct)


_tiled_core.defvjp(_tiled_core_fwd, _tiled_core_bwd)


def _item_length(
    tree: Any, batch: tuple, arg: str, broadcast: bool = False, axes: tuple = ()
) -> int:
    """The common length of the axis after the ``batch`` dims of every leaf of ``tree``
    (with ``broadcast``, a leaf's batch dim may also be 1; with ``axes``, per leaf the
    axis after the batch dims that holds the items)."""
    nb = len(batch)
    leaves, treedef = jax.tree.flatten(tree)
    for leaf in leaves:
        lead = np.shape(leaf)[:nb]
        if len(lead) != nb or any(
            s != b and not (broadcast and s == 1) for s, b in zip(lead, batch)
        ):
            more = " (or 1 to broadcast)" if broadcast else ""
            raise ValueError(
                f"every leaf of {arg} needs leading batch dims {batch}{more}, got {np.shape(leaf)}"
            )
    items = []
    for a, ax in zip(leaves, axes or (0,) * len(leaves)):
        item = tuple(np.shape(a)[nb:])
        if ax and ax >= len(item):
            raise ValueError(f"a leaf of {arg} of shape {np.shape(a)} has no axis {ax}")
        items.append(jax.ShapeDtypeStruct(item[ax : ax + 1] + item[:ax] + item[ax + 1 :], bool))
    return leading_length(jax.tree.unflatten(treedef, items), arg)


def _col_axes(cols: Any, col_axis: Any) -> tuple:
    """``col_axis`` as one non-negative int per leaf of ``cols``."""
    n = len(jax.tree.leaves(cols))
    if isinstance(col_axis, (int, np.integer)) and not isinstance(col_axis, bool):
        axes = [int(col_axis)] * n
    else:
        axes = jax.tree.leaves(col_axis)
        if len(axes) != n or not all(
            isinstance(a, (int, np.integer)) and not isinstance(a, bool) for a in axes
        ):
            raise ValueError(
                f"col_axis must be an int or one int per leaf of cols ({n}), got {col_axis!r}"
            )
    if any(a < 0 for a in axes):
        raise ValueError(f"col_axis must be >= 0 (counted after the batch dims), got {col_axis!r}")
    return tuple(int(a) for a in axes)


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
    forward_mode_error: str = FORWARD_MODE,
    pattern: kernels.Pattern | None = None,
    row_layout: Callable | None = None,
    col_axis: Any = 0,
    backward: str = "rows",
    band: tuple[int, int] | None = None,
    implementation: str | None = None,
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
    (n,))``; ``"logsumexp_pick"``: ``tile_fn`` returns ``(scores (R, C), k (R,) int)``
    and the result is ``(n, 2)``, the log-sum-exp and the score at column ``k_i``
    (``-inf`` where no column is ``k_i``). Reductions accumulate in at least float32 and
    return the scores' dtype (``out``: the values' dtype).

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
    hold a finite score; the others are never visited, forward or backward (each loop
    runs over the live blocks alone). It must depend on the indices and ``consts``
    only: a causal mask halves the work this way.

    ``ring`` (inside ``shard_map`` only): ``cols`` is this device's block of columns
    split over ``ring.axes``; the blocks travel around the devices (``ppermute``) as
    tile-wide slices, each reduced against the local rows while the next is in flight,
    and in the backward each slice's cotangent travels with it back to its owner.
    Memory per device: the local rows and columns, one tile and a few slices. The
    results are over every device's columns (argmax: global indices); ``tiles`` are
    resolved for one block, and ``tile_fn``/``live`` see global column ids. ``pairs``
    hold this device's rows and every column: each step reads its block's columns.

    Forward mode (``jax.jvp``, ``jax.jacfwd``, ``jax.linearize``) through the engine
    raises ``TypeError(forward_mode_error)``: pass a message naming the public function
    and what to use instead. Reverse mode, ``jax.hessian`` and ``jacfwd`` of ``grad``
    work.

    ``row_layout(rows_block) -> rows_block`` (optional) rearranges each row block once,
    before its column tiles, in both passes (leaf by leaf, linear: a transpose moving
    heads first for batched matmuls); ``tile_fn`` then sees the rearranged block, and
    the block's cotangent is pulled back once per block instead of once per tile.

    ``col_axis`` (an int, or one per leaf of ``cols`` as a pytree of its structure):
    the axis after the batch dims along which a column leaf holds its columns (0 by
    default). A ``(d, V)`` output layer is then read as V columns in place, each block
    sliced along axis 1, with no transposed copy.

    ``backward`` picks the backward's loop order. ``"rows"`` (the default): one pass,
    row blocks outer; the cotangents of columns, pairs and consts are summed over the
    row blocks in at least float32, so a bfloat16 column operand gets a float32
    accumulator of its whole size. ``"split"``: the rows' cotangents from that pass, the
    columns' (and pairs', consts') from a second, column-major pass, so each column
    block's cotangent is complete after its pass over the rows and stored once in its
    own dtype: no accumulator of n or m items in float32, for one more evaluation of
    every tile. With only rows (or only columns, pairs and consts) needing a cotangent,
    ``"split"`` runs that one pass.

    ``band=(lo, hi)`` (optional) says every visible pair (row ``i``, column ``j``) has
    ``lo <= j - i <= hi``, as a sliding window's: each row block (and in a column-major
    backward, each column block) then visits only the tiles of its band, laid from the
    band's first column, so a row block of ``R`` rows computes ``R + hi - lo`` columns
    whatever the tile's width (on a grid laid from column 0, a band takes a whole tile
    more wherever it does not start on the grid). Pairs outside the band must still be
    masked by ``tile_fn``; on a ring it is not used.

    ``pattern`` (optional) names what ``tile_fn`` computes, so that a fused kernel
    registered for it and this reduction (:mod:`memwise.engine.kernels`) may run instead
    of the XLA loops, as ``implementation`` asks: ``None`` (the kernel on the platforms
    it is compiled for, the loops elsewhere), ``"xla"`` or ``"pallas"``.

    Example::

        >>> from memwise.tiling import tiling
        >>> x = jnp.arange(6.0)
        >>> add = lambda r, c, _p, _k, _ri, _ci: r[:, None] + c[None, :]
        >>> tiled_reduce(add, x, x, reduce="max", tiles=tiling(6, 6, 4))[0]
        Array([ 5.,  6.,  7.,  8.,  9., 10.], dtype=float32)
    """
    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce must be one of {tuple(REDUCTIONS)}, got {reduce!r}")
    if not isinstance(tiles, Tiling):
        raise TypeError(f"tiles must be a memwise.tiling.Tiling (from tiling()), got {tiles!r}")
    if backward not in ("rows", "split"):
        raise ValueError(f"backward must be 'rows' or 'split', got {backward!r}")
    if band is not None and not (
        len(band) == 2 and all(isinstance(b, int) for b in band) and band[0] <= band[1]
    ):
        raise ValueError(f"band must be two ints (lo, hi) with lo <= hi, got {band!r}")
    batch = tuple(int(b) for b in batch)
    nb = len(batch)
    col_axes = _col_axes(cols, col_axis)
    if ring is not None and (any(col_axes) or backward != "rows"):
        raise ValueError(
            "a ring takes columns along axis 0 and the one-pass backward: leave col_axis "
            "and backward at their defaults"
        )
    shape = (
        _item_length(rows, batch, "rows"),
        _item_length(cols, batch, "cols", True, col_axes),
    )
    if tiles.shape != shape:
        raise ValueError(f"tiles were resolved for {tiles.shape}, but rows x cols is {shape}")
    pair_batch = []
    # with a ring, a pair holds every device's columns (its rows are this device's)
    pair_shape = (shape[0], shape[1] * (1 if ring is None else ring.size))
    for p in jax.tree.leaves(pairs):
        ps = np.shape(p)
        if (
            len(ps) < nb + 2
            or any(s not in (1, b) for s, b in zip(ps, batch))
            or ps[nb] not in (1, pair_shape[0])
            or ps[nb + 1] not in (1, pair_shape[1])
        ):
            raise ValueError(
                f"pairs must have leading dims batch + (n, m) = {batch + pair_shape}, each "
                f"either that size or 1 (broadcast); got {ps}"
            )
        pair_batch.append(ps[:nb])
    col_batch = tuple(tuple(np.shape(c)[:nb]) for c in jax.tree.leaves(cols))
    if all(cb == batch for cb in col_batch):
        col_batch = ()  # nothing broadcasts: no leaf is squeezed
    flat = [jax.tree.flatten(t) for t in (rows, cols, pairs, consts)]
    spec = TileSpec(
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
        row_layout,
        col_axes if any(col_axes) else (),
        backward,
        None if band is None else (int(band[0]), int(band[1])),
    )
    leaves = [
        guard_forward_mode([jnp.asarray(a) for a in lv], forward_mode_error) for lv, _ in flat
    ]
    if ring is not None and col_batch:
        raise ValueError(
            "columns that broadcast over batch dims are not supported with a ring; "
            "give every column leaf the full batch dims"
        )

    def loops(*leaves):
        return (
            _tiled_core(spec, *leaves)
            if ring is None
            else ring_core(ring_spec(spec), ring, *leaves)
        )

    if pattern is None:
        kernels.check_implementation(implementation)
        if implementation == "pallas":
            raise ValueError("implementation='pallas' needs a pattern a kernel can serve")
        return loops(*leaves)
    call = kernels.KernelCall(pattern, reduce, tiles, batch, ring)
    operands = tuple(jax.tree.unflatten(t, lv) for t, lv in zip(spec.trees, leaves))
    return kernels.dispatch(
        call, operands, lambda *trees: loops(*map(jax.tree.leaves, trees)), implementation
    )
