"""The static description of one tiled reduction, and the slicing of its operands.

:class:`TileSpec` is the non-differentiable argument of the engine's custom VJPs: the
tile function, the reduction kind, the resolved :class:`~memwise.tiling.Tiling`, the
operands' tree structures and their batch layout. Blocks of rows and columns are sliced
by index from the unsplit operands (splitting into ``(chunks, size, ...)`` copies them,
under ``vmap`` transposed); a pair operand (mask, bias) is sliced from its own shape,
an axis of size 1 broadcast, never expanded. Which tiles a block visits is decided here
too: the ones a ``live`` predicate keeps (block sparsity, as Splash attention's) and,
where the visible pairs lie in a band, only the tiles of the block's band, laid from
where the band starts.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from memwise._dtypes import accumulation_dtype
from memwise.engine.reductions import REDUCTIONS, Reduction
from memwise.sharding import typed_zeros
from memwise.tiling import Chunking, Tiling

__all__ = [
    "FORWARD_MODE",
    "Band",
    "Leaves",
    "TileSpec",
    "accumulators",
    "made_after",
    "padded_zeros",
    "pair_blocks",
    "store_block",
    "store_order",
]

# The flattened leaves of one pytree operand (rows, cols, pairs or consts).
Leaves = list[jax.Array]


def accumulators(values: Sequence[Any]) -> list:
    """Loop-carry zeros shaped like ``values``, in their accumulation dtype."""
    return [z.astype(accumulation_dtype(z.dtype)) for z in typed_zeros(values)]


def padded_zeros(a: Any, chunks: Chunking, dtype: Any, axis: int) -> jax.Array:
    """Zeros shaped like ``a`` with ``axis`` padded to whole tiles (``chunks.padded``): the
    carry a tile loop writes each block's cotangent into, sliced back afterwards."""
    return jnp.zeros(a.shape[:axis] + (chunks.padded,) + a.shape[axis + 1 :], dtype)


def store_block(
    acc: jax.Array,
    g: jax.Array,
    chunks: Chunking | Band,
    start: jax.Array,
    axis: int,
    add: bool = False,
) -> jax.Array:
    """``acc`` (unpadded along ``axis``) with block ``g`` written (or ``add``-ed) at
    ``start``, where :meth:`Chunking.block` sliced it (``chunk_ids(k)[0][0]``).

    A slid-back last block's slots that repeat the previous block's items hold zero
    cotangents (the reductions mask them): added, they change nothing; stored, they are
    overwritten by their own block afterwards, as blocks that are stored run last first
    (:func:`store_order`), with no read of ``acc`` and no select (XLA:CPU copied the
    whole bfloat16 ``acc`` for one, per block). No padded buffer, and no sliced copy of
    the whole result at the end.
    """
    g = g.astype(acc.dtype)
    if add:
        g = g + lax.dynamic_slice_in_dim(acc, start, chunks.size, axis=axis)
    return lax.dynamic_update_slice_in_dim(acc, g, start, axis=axis)


def store_order(chunks: Chunking) -> jax.Array:
    """The chunk indices last first: the loop order of blocks written by
    :func:`store_block` without ``add``."""
    return chunks.indices()[::-1]


def made_after(zeros: Any, *after: Any) -> Any:
    """``zeros`` (a pytree of zero arrays), computed only once the arrays ``after`` are.

    XLA merges every zero array of one shape into one constant, copies it for each loop
    that writes into it in place, and schedules those copies at the start of the
    program, so each stays alive until its loop has run: 9 point-sized copies lived
    through the whole gradient of an unbalanced Sinkhorn divergence. A zero read from
    a loop's own inputs (a finite value times 0: exactly +0) is made when they are,
    just before the loop, and is no copy. XLA does not fold ``x * 0`` for floats;
    integer zeros fold back into a constant, as before.
    """
    firsts = [
        jnp.real(a[(0,) * a.ndim]).astype(jnp.float32)  # one element: no reshape of a
        for a in jax.tree.leaves(after)
        if isinstance(a, jax.Array) and jnp.issubdtype(a.dtype, jnp.inexact) and a.size
    ]
    if not firsts:
        return zeros
    finite = [jnp.where(jnp.isfinite(v), jnp.abs(v), 0.0) for v in firsts]
    zero = functools.reduce(jnp.add, finite) * 0.0
    return jax.tree.map(lambda z: z * zero.astype(z.dtype), zeros)


FORWARD_MODE = (
    "memwise's tiled reductions support reverse mode (grad, vjp, jacrev; also jax.hessian "
    "and jacfwd of grad) and vmap, but not forward mode through them (jvp, jacfwd, "
    "jax.linearize); for forward mode compute the dense version, or differentiate in "
    "reverse mode"
)


@dataclasses.dataclass(frozen=True)
class Band:
    """The blocks of one operand that one block of the other visits when the visible
    pairs lie in a band (:attr:`TileSpec.band`): ``chunks`` of the band's ``length``,
    counted from ``origin`` (a traced index) instead of from 0.

    It reads as a :class:`~memwise.tiling.Chunking` (``n_chunks``, ``indices``,
    ``chunk_ids``, ``block``): ids are global, and a block is sliced where its ids begin
    (the band lies inside the operand, so nothing is clamped).
    """

    chunks: Chunking
    origin: jax.Array

    @property
    def size(self) -> int:
        return self.chunks.size

    @property
    def n_chunks(self) -> int:
        return self.chunks.n_chunks

    def indices(self) -> jax.Array:
        return self.chunks.indices()

    def chunk_ids(self, k: int | jax.Array) -> tuple[jax.Array, jax.Array]:
        ids, own = self.chunks.chunk_ids(k)
        return ids + self.origin, own

    def block(self, leaf: jax.Array, start: int | jax.Array, *, axis: int = 0) -> jax.Array:
        return lax.dynamic_slice_in_dim(leaf, start, self.chunks.size, axis=axis)


@dataclasses.dataclass(frozen=True, eq=False)
class TileSpec:
    """Static description of one tiled reduction (a nondiff argument of the custom_vjp).

    ``tile_fn(rows, cols, pairs, consts, row_ids, col_ids)`` returns the scores of one
    tile of one problem, shape ``(R, C) + trailing``; for ``"softmax"`` it returns
    ``(scores (R, C), values (C, dv))`` and the reduction is ``sum_j softmax_j(scores)
    values_j``. Scores equal to -inf are excluded (masking).
    """

    tile_fn: Callable
    reduce: str
    tiles: Tiling
    trees: tuple  # treedefs of (rows, cols, pairs, consts)
    batch: tuple = ()  # leading batch dims of rows and cols
    # Per pair leaf: its leading batch dims, 1 where it broadcasts over that batch dim.
    pair_batch: tuple = ()
    # The same per column leaf (grouped-query attention: one K/V head for many heads);
    # empty when every column leaf has the full batch dims (then none is squeezed).
    col_batch: tuple = ()
    upcast: bool = False  # differentiate tiles on float32 copies of the blocks
    vary_consts: bool = True  # see memwise.sharding.convert
    # live(row_ids, col_ids, consts) -> bool scalar: False when every score of the tile is
    # -inf (e.g. above a causal diagonal); such tiles are never visited (over_live).
    live: Callable | None = None
    # The TypeError forward mode raises, naming the caller's public function and the fix.
    forward_mode_error: str = ""
    # row_layout(rows) -> rows: each row block rearranged once, before its column tiles,
    # in both passes (tile_fn sees it; its cotangent is pulled back once per block).
    row_layout: Callable | None = None
    # Per column leaf: the axis of its columns after the batch dims (0 unless given: a
    # (d, V) output layer's words are its axis 1); empty when every leaf's is 0.
    col_axis: tuple = ()
    # The backward's loop order: "rows" (row blocks outer; column, pair and constant
    # cotangents summed over row blocks in at least float32) or "split" (that pass for
    # the rows' cotangents, a column-major one for the others; see tiled_reduce).
    backward: str = "rows"
    # (lo, hi): every visible pair (row i, column j) has lo <= j - i <= hi (a sliding
    # window). A block then visits only the tiles of its band, laid from the band's
    # first item rather than on a grid from 0 (see visits).
    band: tuple[int, int] | None = None

    @property
    def reduction(self) -> Reduction:
        return REDUCTIONS[self.reduce]

    def tile(self, leaves: Sequence[list], row_ids: jax.Array, col_ids: jax.Array) -> Any:
        rows, cols, pairs, consts = (
            jax.tree.unflatten(tree, flat) for tree, flat in zip(self.trees, leaves)
        )
        return self.tile_fn(rows, cols, pairs, consts, row_ids, col_ids)

    def lay_out_rows(self, leaves: list, batched: bool = False) -> list:
        """A row block's leaves in ``row_layout``'s arrangement (unchanged without one);
        ``batched``: the leaves have the batch dims (the backward's blocks)."""
        layout = self.row_layout
        if layout is None:
            return leaves

        def one(*xs):
            return jax.tree.leaves(layout(jax.tree.unflatten(self.trees[0], list(xs))))

        for _ in self.batch if batched else ():
            one = jax.vmap(one)
        return list(one(*leaves))

    def visits(self, chunks: Chunking, ids: jax.Array, over: str = "cols") -> Chunking | Band:
        """The tiles of ``chunks`` that the block whose indices are ``ids`` visits: the
        column tiles of a row block (``over="cols"``) or the row tiles of a column block
        (``"rows"``). Without :attr:`band`, all of them; with one, the tiles of its band
        only, the first starting at the band's first item: a row block of ``R`` rows
        visits ``R + hi - lo`` columns, whatever the tile's width (on a grid from 0 a
        window of 512 keys at 256 x 128 tiles took 6 tiles of 128 where the band is 768
        keys wide; a band tile of 768 is one tile).
        """
        if self.band is None:
            return chunks
        lo, hi = self.band if over == "cols" else (-self.band[1], -self.band[0])
        width = ids.shape[0] + hi - lo
        if width >= chunks.length:
            return chunks
        origin = jnp.clip(ids[0] + lo, 0, chunks.length - width).astype(jnp.int32)
        return Band(Chunking(width, min(chunks.size, width)), origin)

    def over_live(
        self,
        body: Callable[[Any, jax.Array], Any],
        init: Any,
        chunks: Chunking | Band,
        ids: jax.Array,
        const_leaves: list,
        over: str = "cols",
    ) -> Any:
        """``body(carry, k)`` folded over the blocks ``k`` of ``chunks`` in order: the
        column blocks of the row block whose indices are ``ids`` (``over="cols"``), or
        the row blocks of a column block (``"rows"``), visiting only the tiles ``live``
        keeps.

        Block sparsity as Splash attention's: the live blocks' indices are listed first
        (one predicate per tile) and a loop runs over them alone, so a tile a causal
        mask, a window or segment boundaries hide costs neither pass anything, not even
        the zero a branch would add into a carried accumulator (which cost a sliding
        window's gradient 4.6 times its forward at T = 8,192). Without ``live``, one scan
        over every block. The predicate reads tile indices and constants only, so the
        count is unbatched under the engine's own vmap.
        """
        if self.live is None:
            return lax.scan(lambda carry, k: (body(carry, k), None), init, chunks.indices())[0]
        consts = jax.tree.unflatten(self.trees[3], const_leaves)
        live = self.live

        def alive(k):
            other = chunks.chunk_ids(k)[0]
            return live(ids, other, consts) if over == "cols" else live(other, ids, consts)

        keep = lax.map(alive, chunks.indices())
        (order,) = jnp.nonzero(keep, size=chunks.n_chunks, fill_value=0)
        count = jnp.sum(keep, dtype=jnp.int32)
        return lax.fori_loop(0, count, lambda i, carry: body(carry, order[i]), init)

    def pair_axes(self, level: int) -> list:
        """vmap in_axes of the (squeezed) pair leaves at batch dim ``level``."""
        return [None if pb[level] == 1 else 0 for pb in self.pair_batch]

    def col_axes(self, level: int) -> list:
        """vmap in_axes of the (squeezed) column leaves at batch dim ``level``."""
        if not self.col_batch:
            return [0] * self.trees[1].num_leaves
        return [None if cb[level] == 1 else 0 for cb in self.col_batch]

    def squeeze_pairs(self, pairs: list) -> list:
        """Pair leaves without the batch dims they broadcast over (a reshape, no copy)."""
        return _squeeze(pairs, self.pair_batch, len(self.batch))

    def squeeze_cols(self, cols: list) -> list:
        """Column leaves without the batch dims they broadcast over (no copy)."""
        if not self.col_batch:
            return list(cols)
        return _squeeze(cols, self.col_batch, len(self.batch))

    def col_lead(self) -> list:
        """Per squeezed column leaf: the axis of its columns."""
        return [k + a for k, a in zip(self.col_batch_dims(), self.item_col_axis())]

    def col_batch_dims(self) -> list:
        """Per squeezed column leaf: how many batch dims lead it."""
        if not self.col_batch:
            return [len(self.batch)] * self.trees[1].num_leaves
        return [sum(s != 1 for s in cb) for cb in self.col_batch]

    def item_col_axis(self) -> list:
        """Per column leaf: the axis of its columns in one problem's leaf (no batch dims)."""
        return list(self.col_axis) or [0] * self.trees[1].num_leaves

    def over_batch(
        self,
        fn: Callable,
        in_axes: Callable[[int], tuple],
        out_axes: Any = 0,
        squeeze_units: bool = True,
    ) -> Callable:
        """``fn`` of one problem vmapped over the batch dims, outermost first.

        With ``squeeze_units``, a batch dim of size 1 is squeezed off the inputs and put
        back on the results instead (the same values). Under a vmap of size 1, XLA drops
        the unit dim from a tile's matmuls but not from the elementwise work between
        them, and a buffer of one shape is not reused for a value of the other:
        attention's backward on a ``(1, L, d)`` query held its scores, their exponential
        and ``dP`` at once, three tiles where two do (L = 65,536 over 8 devices: 1 MiB
        a device). The forward's whole-problem map keeps the vmap: squeezed there,
        XLA:CPU copied grouped-query attention's query twice (T = 65,536, 8 heads:
        temporaries 137 -> 514 MiB).
        """
        for level in reversed(range(len(self.batch))):
            if self.batch[level] == 1 and squeeze_units:
                fn = _over_unit_dim(fn, in_axes(level), out_axes)
            else:
                fn = jax.vmap(fn, in_axes=in_axes(level), out_axes=out_axes)
        return fn


def _over_unit_dim(fn: Callable, in_axes: Any, out_axes: Any) -> Callable:
    """``jax.vmap(fn, in_axes, out_axes)`` for a mapped dim of size 1: that dim
    squeezed off the mapped inputs, ``fn`` applied, the dim put back on the results."""

    def at_axes(change: Callable, axes: Any, tree: Any) -> Any:
        # ``axes`` is a prefix of ``tree``, as vmap's in_axes and out_axes are.
        return jax.tree.map(
            lambda ax, sub: sub if ax is None else jax.tree.map(lambda a: change(a, ax), sub),
            axes,
            tree,
            is_leaf=lambda x: x is None,
        )

    def unit(*args: Any) -> Any:
        axes = tuple(in_axes) if isinstance(in_axes, (tuple, list)) else (in_axes,) * len(args)
        out = fn(*at_axes(lambda a, ax: jnp.squeeze(a, ax), axes, args))
        return at_axes(jnp.expand_dims, out_axes, out)

    return unit


def _squeeze(leaves: list, leaf_batch: tuple, nb: int) -> list:
    """Each leaf without the leading batch dims it broadcasts over (size 1 in ``leaf_batch``)."""
    return [
        a.reshape(tuple(s for s in lb if s != 1) + a.shape[nb:])
        for a, lb in zip(leaves, leaf_batch)
    ]


def pair_blocks(
    rows: Chunking | Band,
    cols: Chunking | Band,
    pairs: list,
    i_start: int | jax.Array,
    j_start: int | jax.Array,
    lead: Sequence[int] | None = None,
) -> list:
    """The tile of each pair operand at ``(i_start, j_start)``, no copy.

    A pair's row and column axes sit after its ``lead`` batch dims; an axis of size 1
    broadcasts (a key-padding mask is ``(1, m)``) and is not sliced.
    """
    out = []
    for p, k in zip(pairs, lead or [0] * len(pairs)):
        if p.shape[k] != 1:
            p = rows.block(p, i_start, axis=k)
        if p.shape[k + 1] != 1:
            p = cols.block(p, j_start, axis=k + 1)
        out.append(p)
    return out
