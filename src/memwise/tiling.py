"""How an axis is cut into chunks and a pairwise computation into tiles, and what it costs.

Every chunked primitive in memwise (``chunked_map``/``chunked_sum``, ``pairwise_reduce``,
``attention``, ``ot``, ``ntk``) resolves its ``chunk_size`` here, once, into a plain
object that the loops then follow:

* :class:`Chunking` cuts one axis of ``length`` items into ``n_chunks`` chunks of
  ``size``; a ragged last chunk is slid back to end at the last item (so user functions
  only ever see real inputs, and a chunk is one plain slice) and its slots that repeat
  the previous chunk's items are masked, so there is never a second compiled body for
  the remainder.
* :class:`Tiling` is a 2-D tiling with explicit forward and backward tiles, as Pallas'
  attention kernels carry ``BlockSizes``: the backward pass of a tile holds the tile's
  scores, their cotangent and the user function's residuals, about twice a forward
  tile's live set, so by default its tile has half the rows. Both tiles are visible on
  the object and can be set (``tiling(..., backward=(rows, cols))``).
* ``"auto"`` sizes come from one rule for the memory of a tile, the bytes per item
  (:func:`item_bytes`: three times the intermediates of one item, as traced: the
  forward's live values, the vjp's residuals and their cotangents; for pairs,
  :func:`pair_bytes` traces a small tile and splits its bytes into per pair, per row and
  per column, as vmap computes them), and one cost model
  for its time (:func:`_tile_costs`): a tile's body (the user function over the tile,
  reduced over its columns with the engine's max-shifted sum of exponentials) is
  compiled and XLA's ``cost_analysis()`` of it, flops and bytes accessed at each
  candidate's size (:func:`memwise.costmodel.tile_cost`), is combined with the machine's measured balance
  into a roofline time (:mod:`memwise.costmodel`), times the number of tiles. So a cheap, memory-bound pair function gets a cache-sized tile on a CPU and a
  compute-bound one the largest tile. The tile bodies are compiled only inside
  ``mw.fit`` (where the costs are read), once per function, shapes and tile. Where the
  body cannot be compiled apart (it closes over traced values), the count model of
  padded items x bytes per item + tiles x a per-tile loop overhead stands in.

The model's known limits: a tile's flops, bytes and working set are read off two compiled
sizes (linear in the tile's pairs), and a one-tile tiling is priced by its arithmetic alone (XLA removes the one-trip loop
and fuses the reduction); ``mw.fit(tune=True)`` times the chosen plan's neighbours instead.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from memwise import costmodel, knobs
from memwise._arguments import positive_int
from memwise._item_bytes import _FALLBACK_ITEM_BYTES, ItemBytes, item_bytes, pair_bytes

__all__ = [
    "TILE_BYTES",
    "Chunking",
    "Tiling",
    "DeviceShare",
    "chunking",
    "tiling",
    "item_bytes",
    "leading_length",
    "pair_bytes",
]

# A tile of about this many bytes of intermediates: large enough that the per-tile loop
# overhead is negligible, small enough to be a rounding error next to the inputs.
TILE_BYTES = 8 * 2**20


class DeviceShare(NamedTuple):
    """One device's share of a ring step on D devices: ``rows x cols`` pairs (``n / D``
    by ``m / D``) and ``nbytes``, the bytes of its share of the operands. ``"auto"``
    tiles for it (:func:`tiling`'s ``auto_shape``)."""

    rows: int
    cols: int
    nbytes: int


# Per-chunk loop overhead, in bytes of intermediates processed: a loop iteration costs a
# few microseconds, about as long as streaming 64 KiB of intermediates. The cost of a
# chunk size is then (padded items x bytes per item + chunks x this), so cheap items
# want large chunks and expensive items amortise the loop at any size.
_LOOP_OVERHEAD_BYTES = 64 * 2**10


@dataclasses.dataclass(frozen=True)
class Chunking:
    """How one axis of ``length`` items is cut into ``n_chunks`` chunks of ``size``.

    Chunk ``k`` is the slice of ``size`` items from ``min(k * size, length - size)``: a
    ragged last chunk is slid back to end at the last item, so a chunk body sees only
    real items, and its first slots repeat the previous chunk's last items;
    :meth:`chunk_ids` says which slots are the chunk's own. (Rolling the last chunk
    into place instead cost a dynamic roll of every block, which XLA:CPU fused into the
    tile's elementwise work: a ragged tiling of a 5,000-point log-sum-exp ran 5x
    slower than an even one.)

    Example::

        >>> c = Chunking(10, 4)
        >>> c.n_chunks, c.padded, c.ragged
        (3, 12, True)
        >>> ids, valid = c.chunk_ids(2)
        >>> [int(i) for i in ids], [bool(v) for v in valid]
        ([6, 7, 8, 9], [False, False, True, True])
    """

    length: int
    size: int

    @property
    def n_chunks(self) -> int:
        return -(-self.length // self.size)

    @property
    def padded(self) -> int:
        return self.n_chunks * self.size

    @property
    def ragged(self) -> bool:
        return self.padded != self.length

    def split(self, tree: Any) -> Any:
        """``(length, ...)`` leaves -> ``(n_chunks, size, ...)``, chunk ``k`` as
        :meth:`block` slices it (the inverse of :meth:`merge`)."""

        def one(leaf):
            leaf = jnp.asarray(leaf)
            if not self.ragged:
                return leaf.reshape((self.n_chunks, self.size) + leaf.shape[1:])
            head = leaf[: (self.n_chunks - 1) * self.size]
            head = head.reshape((self.n_chunks - 1, self.size) + leaf.shape[1:])
            return jnp.concatenate([head, leaf[None, self.length - self.size :]], axis=0)

        return jax.tree.map(one, tree)

    def merge(self, tree: Any) -> Any:
        """``(n_chunks, size, ...)`` leaves, chunk ``k`` as :meth:`block` slices it ->
        ``(length, ...)`` (the slid-back last chunk's repeated slots dropped)."""
        if not self.ragged:
            return jax.tree.map(lambda a: a.reshape((self.length,) + a.shape[2:]), tree)
        repeated = self.padded - self.length

        def one(a):
            head = a[:-1].reshape(((self.n_chunks - 1) * self.size,) + a.shape[2:])
            return jnp.concatenate([head, a[-1, repeated:]], axis=0)

        return jax.tree.map(one, tree)

    def indices(self) -> jax.Array:
        """``0 .. n_chunks - 1`` (int32): what a loop over the chunks scans."""
        return jnp.arange(self.n_chunks, dtype=jnp.int32)

    def chunk_ids(self, k: int | jax.Array) -> tuple[jax.Array, jax.Array]:
        """Global index of each slot of chunk ``k`` (``ids[0]`` is where it starts) and
        whether the slot is the chunk's own item (False where a slid-back last chunk
        repeats the previous chunk's items).

        Computed inside the loop body from ``k``, so a loop over the chunks holds one
        chunk's ids at a time: never a table of all of them, which as a NumPy array would
        be baked into the program as a constant that grows with the number of points.
        """
        start = k * self.size
        ids = self.start(start) + lax.iota(jnp.int32, self.size)
        return ids, ids >= start

    def start(self, start: int | jax.Array) -> jax.Array:
        """Where the chunk that begins at item ``start`` is sliced from: slid back to end
        at the last item when it would run past it."""
        return jnp.minimum(start, self.length - self.size)

    def block(self, leaf: jax.Array, start: int | jax.Array, *, axis: int = 0) -> jax.Array:
        """The chunk beginning at item ``start`` along ``axis`` of an unpadded array: one
        slice from :meth:`start` (slot ``j`` holds item ``start(start) + j``).

        No padded copy of ``leaf`` is made (it may be a large n x m mask or bias).
        """
        return lax.dynamic_slice_in_dim(leaf, self.start(start), self.size, axis=axis)


@dataclasses.dataclass(frozen=True)
class Tiling:
    """A 2-D tiling of an ``n x m`` pairwise computation, forward and backward.

    ``rows``/``cols`` cut the forward pass; ``backward_rows``/``backward_cols`` the
    backward pass. Made by :func:`tiling`, which also takes a resolved ``Tiling`` as
    ``chunk_size`` (so a caller resolves once and hands the object down).

    Example::

        >>> t = tiling(20_000, 20_000, (1024, 2048))
        >>> (t.rows.size, t.cols.size), (t.backward_rows.size, t.backward_cols.size)
        ((1024, 2048), (512, 2048))
    """

    rows: Chunking
    cols: Chunking
    backward_rows: Chunking
    backward_cols: Chunking

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows.length, self.cols.length

    def _backward(self) -> tuple[int, int] | None:
        """The backward tile as set explicitly, or None where it follows the default."""
        explicit = (self.backward_rows.size, self.backward_cols.size)
        return None if explicit == _default_backward(self.rows.size, self.cols.size) else explicit

    def resized(self, n: int, m: int) -> Tiling:
        """The same tile sizes for an ``n x m`` computation (clipped to it)."""
        return tiling(n, m, (self.rows.size, self.cols.size), backward=self._backward())

    def transposed(self) -> Tiling:
        """The tiles for the ``m x n`` problem (rows and columns swapped).

        A backward tile set explicitly is swapped too; a default one follows the default
        rule in the new orientation (half the new rows).
        """
        backward = self._backward()
        return tiling(
            self.cols.length,
            self.rows.length,
            (self.cols.size, self.rows.size),
            backward=None if backward is None else backward[::-1],
        )


ChunkSize = int | tuple | str | Tiling


def _check_positive_int(value: Any, arg: str) -> int:
    return positive_int(
        value,
        arg,
        accepts=", a (rows, cols) tuple of them, or 'auto'",
        fix=f"; pass e.g. {arg}=1024 or 'auto'",
    )


def leading_length(tree: Any, arg: str) -> int:
    """The common leading length of the leaves of ``tree`` (the items to chunk over)."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        raise ValueError(f"{arg} has no arrays: pass an array or a pytree of arrays")
    if any(np.ndim(leaf) == 0 for leaf in leaves):
        raise ValueError(f"every leaf of {arg} needs a leading axis to chunk over (got a scalar)")
    lengths = {int(np.shape(leaf)[0]) for leaf in leaves}
    if len(lengths) != 1:
        raise ValueError(
            f"the leaves of {arg} have different leading lengths {sorted(lengths)}; "
            "they must all index the same items"
        )
    return lengths.pop()


def _relative_cost(work: Sequence[float]) -> list[float]:
    """Relative work per candidate of the count model, made nondecreasing."""
    base = work[0]
    out, running = [], 1.0
    for w in work:
        running = max(running, w / base)
        out.append(running)
    return out


def _pow2_floor(v: int) -> int:
    return 1 << (max(int(v), 1).bit_length() - 1)


def _bytes(estimate: int | Callable[[], int] | None) -> int:
    """Bytes per item from a number or a zero-argument estimator (called only here)."""
    if callable(estimate):
        estimate = estimate()
    if isinstance(estimate, ItemBytes) and estimate > 0:
        return estimate
    return max(int(estimate or _FALLBACK_ITEM_BYTES), 1)


def _tile_costs(
    per_item: int,
    shape: tuple[int, ...],
    candidates: Sequence[tuple],
    count_work: Callable[[tuple], float],
    count_tiles: Callable[[tuple], int] | None = None,
) -> dict[tuple, float]:
    """Relative predicted time of each candidate tile (candidate 0 is 1.0).

    The roofline of :mod:`memwise.costmodel` for the tile body of ``per_item``'s
    function, times ``count_tiles(tile)`` tiles (default: every tile of ``shape``); the
    count model ``count_work`` where that body cannot be compiled.
    """
    times: list[float] | None = None
    if isinstance(per_item, ItemBytes) and per_item.fn is not None:
        machine = costmodel.machine()
        times = []
        for tile in candidates:
            cost = costmodel.tile_cost(per_item, shape, tile)
            if cost is None:
                times = None
                break
            if count_tiles is None:
                tiles = math.prod(Chunking(n, t).n_chunks for n, t in zip(shape, tile))
            else:
                tiles = count_tiles(tile)
            times.append(costmodel.tile_time(cost, tiles, machine))
    if times is None:
        times = _relative_cost([count_work(t) for t in candidates])
    return {tile: t / times[0] for tile, t in zip(candidates, times)}


def chunking(
    length: int,
    chunk_size: int | str | Chunking,
    *,
    item_bytes: int | Callable[[], int] | None = None,
    arg: str = "chunk_size",
) -> Chunking:
    """Resolve ``chunk_size`` for one axis of ``length`` items.

    Args:
      length: number of items (>= 1).
      chunk_size: a positive int (clipped to ``length``), a resolved :class:`Chunking`,
        or ``"auto"``: a :func:`memwise.knobs.auto` knob whose candidates run from one
        chunk (fastest) to small chunks, defaulting to about :data:`TILE_BYTES` of
        intermediates per chunk.
      item_bytes: bytes per item for ``"auto"``, or a zero-argument function giving it
        (called only for ``"auto"``; see :func:`item_bytes`).
      arg: argument name used in error messages.

    Example::

        >>> c = chunking(10, 4)
        >>> c, c.split(jnp.arange(10.0)).shape  # 3 chunks, the last slid back: 6..9
        (Chunking(length=10, size=4), (3, 4))
    """
    if length < 1:
        raise ValueError(f"cannot chunk an axis of length {length}: it needs >= 1 item")
    if isinstance(chunk_size, Chunking):
        if chunk_size.length != length:
            raise ValueError(
                f"{arg} was resolved for {chunk_size.length} items, but this axis has {length}"
            )
        return chunk_size
    if isinstance(chunk_size, str):
        if chunk_size != "auto":
            raise ValueError(f"{arg} must be a positive int or 'auto', got {chunk_size!r}")
        per_item = _bytes(item_bytes)
        default = _pow2_floor(max(1, TILE_BYTES // per_item))
        candidates = [length] + [
            s for s in (2**k for k in range(16, -1, -1)) if s < length and s >= 1
        ][:12]

        def work(size: tuple[int]) -> int:
            c = Chunking(length, size[0])
            return c.padded * per_item + _LOOP_OVERHEAD_BYTES * c.n_chunks

        table: dict = {}

        def cost(size: int) -> float:  # evaluated inside fit only
            if not table:
                table.update(_tile_costs(per_item, (length,), [(c,) for c in candidates], work))
            return table[(size,)]

        size = knobs.auto(
            "chunk_size", candidates=candidates, cost=cost, default=min(default, length)
        )
        return Chunking(length, min(int(size), length))
    return Chunking(length, min(_check_positive_int(chunk_size, arg), length))


def _default_backward(rows: int, cols: int) -> tuple[int, int]:
    # A tile's vjp holds its scores, their cotangent and fn's residuals: about twice a
    # forward tile's live set. Half the rows keeps the gradient's peak near the forward's.
    return max(1, rows // 2), cols


def _tile_pair(value: Any, arg: str) -> tuple[int, int]:
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{arg} as a tuple must be (rows, cols), got {value!r}")
        rows, cols = (
            positive_int(
                part,
                f"{arg}'s {side} ({arg}=(rows, cols))",
                fix=f"; pass e.g. {arg}=(1024, 1024) or 'auto'",
            )
            for part, side in zip(value, ("rows", "cols"))
        )
        return rows, cols
    size = _check_positive_int(value, arg)
    return size, size


# A band tile is a row block's whole work. Held to TILE_BYTES, a sliding window of 512
# keys at T = 16,384 (8 heads of 64) got 64 x 576 tiles and took 0.050 of full
# attention's time on XLA:CPU, whose cost per tile outweighs the flops it skips; in
# 128 x 640 tiles (2.5x the bytes) it took 0.036. The backward's tile keeps its usual
# bytes (tiling), so the gradient holds no more.
_BAND_TILE_BYTES = 4 * TILE_BYTES


def _auto_tile(
    n: int, m: int, per_pair: int, band: int | None = None, budget: int = TILE_BYTES
) -> tuple[int, int]:
    def fit(pairs: int) -> tuple[int, int]:
        cols = min(m, _pow2_floor(max(1, int(math.isqrt(max(pairs, 1))))))
        rows = min(n, _pow2_floor(max(1, pairs // cols)))
        cols = min(m, _pow2_floor(max(1, pairs // rows)))
        return rows, cols

    per_row, per_col = getattr(per_pair, "per_row", 0), getattr(per_pair, "per_col", 0)

    def nbytes(tile: tuple[int, int]) -> int:
        return per_pair * tile[0] * tile[1] + per_row * tile[0] + per_col * tile[1]

    pairs = budget // per_pair
    default = fit(pairs)
    while nbytes(default) > budget and pairs > 1:
        pairs //= 2
        default = fit(pairs)
    if band is not None:
        # One tile as wide as a row block's band (rows + band columns), with the most
        # rows, down to half the default's, whose tile fits _BAND_TILE_BYTES.
        rows = default[0]
        while rows >= max(1, default[0] // 2) and rows + band < m:
            if nbytes((rows, rows + band)) <= _BAND_TILE_BYTES:
                default = (rows, rows + band)
                break
            rows //= 2
    candidates = []
    for k in range(26, 7, -1):  # largest first
        tile = fit(2**k)
        if tile not in candidates:
            candidates.append(tile)
    if default not in candidates:
        candidates.append(default)
        candidates.sort(key=lambda t: -t[0] * t[1])

    def visited(tile):  # a row block's chunks, and the column chunks each one visits
        # (with a band, the tiles of its band only)
        return Chunking(n, tile[0]), Chunking(
            m if band is None else min(m, tile[0] + band), tile[1]
        )

    def tiles_visited(tile):
        r, c = visited(tile)
        return r.n_chunks * c.n_chunks

    def work(tile):
        r, c = visited(tile)
        return (
            r.padded * c.padded * per_pair
            + per_row * r.padded * c.n_chunks
            + per_col * c.padded * r.n_chunks
            + _LOOP_OVERHEAD_BYTES * r.n_chunks * c.n_chunks
        )

    table: dict = {}

    def cost(tile: tuple[int, int]) -> float:  # evaluated inside fit only
        if not table:
            table.update(_tile_costs(per_pair, (n, m), candidates, work, tiles_visited))
        return table[tile]

    return knobs.auto("chunk_size", candidates=candidates, cost=cost, default=default)


def tiling(
    n: int,
    m: int,
    chunk_size: ChunkSize,
    *,
    pair_bytes: int | Callable[[], int] | None = None,
    backward: int | tuple[int, int] | None = None,
    arg: str = "chunk_size",
    auto_shape: DeviceShare | None = None,
    band: int | None = None,
) -> Tiling:
    """Resolve a 2-D ``chunk_size`` into a :class:`Tiling` of an ``n x m`` computation.

    Args:
      n: rows (>= 1).
      m: columns (>= 1).
      chunk_size: an int (square tiles), a ``(rows, cols)`` tuple, a resolved
        :class:`Tiling` (returned as it is; one of another shape lends its tile sizes,
        e.g. per device inside ``shard_map``), or ``"auto"``: a
        :func:`memwise.knobs.auto` knob over square-ish power-of-two tiles, largest first,
        defaulting to about :data:`TILE_BYTES` of intermediates per tile. Sizes are
        clipped to ``n`` and ``m``.
      pair_bytes: bytes per pair for ``"auto"``, or a zero-argument function giving it
        (called only for ``"auto"``; see :func:`item_bytes`).
      backward: the backward pass's tile (an int or ``(rows, cols)``); default: the
        forward tile with half the rows, since a tile's vjp holds about twice what its
        forward holds.
      arg: argument name used in error messages.
      auto_shape: on D devices, one device's share of a ring step
        (:class:`DeviceShare`), which ``"auto"`` chooses its tile for, so the knob is the
        same whether the second operand travels or is held whole. Its tile is held to
        the bytes of the device's share of the operands (not below an eighth of
        :data:`TILE_BYTES`) where they are fewer than :data:`TILE_BYTES`: the tile's
        intermediates then stay small next to the inputs as the device count grows, and
        per-device memory falls as 1/D.
      band: the width ``hi - lo`` of the band every visible pair lies in, where the
        engine visits bands (its ``band`` argument): ``"auto"`` then defaults to one tile
        per row block, ``rows + band`` columns wide, with the most rows (down to half
        the usual default's) that keep it within four times :data:`TILE_BYTES`; with
        none, the usual default. Its backward tile keeps the usual backward's bytes.

    Example::

        >>> t = tiling(20_000, 20_000, (1024, 2048))
        >>> t.rows.n_chunks, t.cols.n_chunks
        (20, 10)
    """
    if n < 1 or m < 1:
        raise ValueError(f"cannot tile an empty {n} x {m} pairwise computation")
    if isinstance(chunk_size, Tiling):
        return chunk_size if chunk_size.shape == (n, m) else chunk_size.resized(n, m)
    if isinstance(chunk_size, str):
        if chunk_size != "auto":
            raise ValueError(
                f"{arg} must be a positive int, a (rows, cols) tuple or 'auto', got {chunk_size!r}"
            )
        per_pair = _bytes(pair_bytes)
        if auto_shape is None:
            rows, cols = _auto_tile(n, m, per_pair, band)
        else:
            budget = min(TILE_BYTES, max(auto_shape.nbytes, TILE_BYTES // 8))
            rows, cols = _auto_tile(auto_shape.rows, auto_shape.cols, per_pair, band, budget)
        banded = band is not None and cols == rows + band
    else:
        rows, cols = _tile_pair(chunk_size, arg)
        banded, per_pair = False, 1
    rows, cols = min(rows, n), min(cols, m)
    if backward is None and banded:
        # The backward of a band tile keeps the usual backward's budget (half a tile's
        # bytes: its vjp holds about twice what the forward holds) with the forward's
        # rows: fewer rows visit more of the band per row. For a window of 512 at
        # T = 16,384 (8 heads of 64), 128 x 128 backward tiles took 0.85x the value and
        # gradient's time in 64 x 256 ones, in the same compiled temp.
        back_rows = rows
        back_cols = min(cols, _pow2_floor(TILE_BYTES // (2 * per_pair * rows)))
    elif backward is None:
        back_rows, back_cols = _default_backward(rows, cols)
    else:
        back_rows, back_cols = _tile_pair(backward, "backward")
    return Tiling(
        Chunking(n, rows),
        Chunking(m, cols),
        Chunking(n, min(back_rows, n)),
        Chunking(m, min(back_cols, m)),
    )
