"""The engine's ring form: columns split over a mesh axis, each block passed around.

Inside ``shard_map``, every device holds ``m / size`` columns; slice by slice they
travel to the next device (``ppermute``) while the current one is reduced against the
local rows, and the slices' statistics merge with the reduction's
:meth:`~memwise.engine.reductions.Reduction.combine` (ring attention: Liu, Zaharia,
Abbeel, arXiv:2310.01889). In the backward each slice's cotangent travels with it, so
after ``size`` steps every slice is home with the cotangent summed over every device's
rows. A block goes round as tile-wide slices, one after the other (sub-block
pipelining): no all-gather, and beyond its own rows and columns a device holds one
tile and a few slices (the one reduced, the one in flight and, in the backward, their
cotangents), not whole blocks: what it holds beyond its share of the operands does
not grow with them (the tile does not shrink with ``size``). Pairs (masks, biases)
are split like the rows and whole along the columns: each step reads the columns of
the slice it holds, and a pair's cotangent is written there, so pairs cost what they
hold (1/size of the whole)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from memwise._dtypes import accumulation_dtype
from memwise._vjp import Static, cotangents, custom_vjp, is_zero, select, unwrap
from memwise.engine.backward import add_block, backward, last_read, row_data
from memwise.engine.forward import statistics
from memwise.engine.tiles import Leaves, TileSpec, accumulators, made_after, padded_zeros
from memwise.sharding import psum_replicated, vary, varying_over

__all__ = ["Ring", "ring_core", "ring_spec"]


@dataclasses.dataclass(frozen=True)
class Ring:
    """Inside ``shard_map``: the mesh axis (or axes) the columns are split over, and its
    number of devices. Every device holds ``m / size`` columns; block by block they
    travel to the next device (``ppermute``) while the current one is reduced."""

    axes: Any
    size: int


def ring_spec(spec: TileSpec) -> TileSpec:
    """``spec`` for one column block of a ring: its consts gain the block's first global
    column, added to the column ids ``tile_fn`` and ``live`` see (a causal mask compares
    global positions); the loops still slice with block-local ids, so no band (a band is
    read in the loops' ids)."""
    tile_fn, live = spec.tile_fn, spec.live

    def shifted(rows, cols, pairs, consts, row_ids, col_ids):
        user, offset = consts
        out = tile_fn(rows, cols, pairs, user, row_ids, col_ids + offset)
        return spec.reduction.localize_tile(out, offset)

    def shifted_live(row_ids, col_ids, consts):
        assert live is not None  # installed only when spec has live
        user, offset = consts
        return live(row_ids, col_ids + offset, user)

    user = jax.tree.unflatten(spec.trees[3], [0] * spec.trees[3].num_leaves)
    return dataclasses.replace(
        spec,
        tile_fn=shifted,
        live=None if live is None else shifted_live,
        trees=spec.trees[:3] + (jax.tree.structure((user, 0)),),
        band=None,
    )


def _ring_permutation(ring: Ring) -> list[tuple[int, int]]:
    """``ppermute``'s pairs sending each device's block to the next device of the ring.

    The ring's order is ``lax.axis_index(ring.axes)``'s, the axes in the order given
    (that of the data's blocks), while ``ppermute`` over several axes numbers the
    devices in the mesh's order of those axes: each pair is translated from one to the
    other (``P(None, ("s", "b"))`` on a ``("b", "s")`` mesh otherwise sent block 1 to
    block 6's device, and causal masks read the wrong key positions).
    """
    given = tuple(ring.axes) if isinstance(ring.axes, (tuple, list)) else (ring.axes,)
    mesh_order = [name for name in jax.sharding.get_abstract_mesh().axis_names if name in given]
    if len(given) == 1 or list(given) == mesh_order:
        return [(i, (i + 1) % ring.size) for i in range(ring.size)]
    sizes = {name: lax.axis_size(name) for name in given}

    def coordinates(index: int) -> dict:  # an index in the given order, per axis
        out = {}
        for name in reversed(given):
            index, out[name] = divmod(index, sizes[name])
        return out

    def numbered(coords: dict) -> int:  # ppermute's number of those coordinates
        index = 0
        for name in mesh_order:
            index = index * sizes[name] + coords[name]
        return index

    return [
        (numbered(coordinates(i)), numbered(coordinates((i + 1) % ring.size)))
        for i in range(ring.size)
    ]


def _rotate(tree: Any, ring: Ring) -> Any:
    """Every device's ``tree`` sent to the next device of the ring."""
    perm = _ring_permutation(ring)
    return jax.tree.map(lambda a: lax.ppermute(a, ring.axes, perm), tree)


def _block_offset(ring: Ring, m_local: int, step: int | jax.Array) -> jax.Array:
    """The first global column of the block a device holds at ``step``: it started on
    the device ``step`` places before this one."""
    me = lax.axis_index(ring.axes)
    return (((me - step) % ring.size) * m_local).astype(jnp.int32)


def _pair_columns(pairs: Leaves, nb: int, offset: jax.Array, m_local: int) -> list:
    """The columns ``[offset, offset + m_local)`` of each pair (one that broadcasts over
    the columns, size 1 there, whole)."""
    return [
        p if p.shape[nb + 1] == 1 else lax.dynamic_slice_in_dim(p, offset, m_local, axis=nb + 1)
        for p in pairs
    ]


def _slices(spec: TileSpec, m_local: int) -> list[tuple[int, int]]:
    """``(count, width)`` runs of the column slices a ring sends, in order: as many
    tile-wide slices as fit in a device's ``m_local`` columns, then the rest as one.

    Each slice goes round the whole ring before the next one leaves home, so a device
    holds one slice and receives another (and, in the backward, their cotangents), not
    whole blocks: the working set is a few tiles, whatever the share of the operand."""
    tiles = spec.tiles
    width = min(m_local, max(tiles.cols.size, tiles.backward_cols.size))
    full, rest = divmod(m_local, width)
    return [(full, width)] + ([(1, rest)] if rest else [])


def _over_slices(sub_ring: Any, carry: Any, spec: TileSpec, m_local: int) -> Any:
    """``carry`` through ``sub_ring(carry, start, width)`` for every slice, in order (a
    ``lax.scan`` over the tile-wide ones after the first)."""
    (full, width), *rest = _slices(spec, m_local)
    carry = sub_ring(carry, 0, width)
    if full > 1:
        over = lambda carry, s: (sub_ring(carry, s * width, width), None)  # noqa: E731
        carry, _ = lax.scan(over, carry, jnp.arange(1, full, dtype=jnp.int32))
    for _, last in rest:
        carry = sub_ring(carry, full * width, last)
    return carry


def _sliced_spec(spec: TileSpec, width: int) -> TileSpec:
    """``spec`` for a column slice of ``width`` (the same tile sizes, clipped to it)."""
    return dataclasses.replace(spec, tiles=spec.tiles.resized(spec.tiles.rows.length, width))


def _ring_statistics(
    spec: TileSpec, ring: Ring, rows: Leaves, cols: Leaves, pairs: Leaves, consts: Leaves
) -> tuple[Any, Any]:
    """``(tile type, statistics over every device's columns)``."""
    nb = len(spec.batch)
    m_local = cols[0].shape[nb]
    combine = spec.reduction.combine
    tile_type = []  # the first slice's (every slice's tiles have one type)

    def sub_ring(stats, start, width):
        """``stats`` combined with the slice ``[start, start + width)`` of every
        device's block, the slice travelling round the ring."""
        sub = _sliced_spec(spec, width)

        def block(blk, step):
            offset = _block_offset(ring, m_local, step) + start
            pair_blk = _pair_columns(pairs, nb, offset, width)
            first, stats = statistics(sub, rows, blk, pair_blk, [*consts, offset])
            return first, spec.reduction.globalize(stats, offset)

        blk = [lax.dynamic_slice_in_dim(c, start, width, axis=nb) for c in cols]
        in_flight = _rotate(blk, ring)  # the next slice travels while this one is reduced
        first, here = block(blk, 0)
        tile_type.append(first)
        stats = here if stats is None else combine(stats, here)

        def step(carry, i):
            blk, stats = carry
            in_flight = _rotate(blk, ring)  # (the last step's send is not used)
            return (in_flight, combine(stats, block(blk, i)[1])), None

        (_, stats), _ = lax.scan(step, (in_flight, stats), jnp.arange(1, ring.size))
        return stats

    stats = _over_slices(sub_ring, None, spec, m_local)
    return tile_type[0], stats


@functools.partial(
    custom_vjp,
    nondiff_argnums=(0, 1),
    forward_mode_error=lambda spec, _ring: spec.forward_mode_error,
)
def ring_core(
    spec: TileSpec, ring: Ring, rows: Leaves, cols: Leaves, pairs: Leaves, consts: Leaves
) -> Any:
    return spec.reduction.finish(*_ring_statistics(spec, ring, rows, cols, pairs, consts))[0]


def _ring_core_fwd(spec, ring, *primals):
    values, flags = zip(*(unwrap(p) for p in primals))
    out, residual = spec.reduction.finish(*_ring_statistics(spec, ring, *values))
    return out, (values, residual, Static(flags))


def _ring_core_bwd(spec, ring, res, ct):
    """The tiled backward of each slice against the global statistics, the slice and
    its cotangent travelling on together: after ``size`` steps every slice is home with
    the cotangent summed over every device's rows (ring attention's backward), written
    into the block's cotangent in the columns' dtype. The tile loops add straight into
    the carried accumulators (no per-slice copies)."""
    values, residual, flags = res
    row_f, col_f, pair_f, const_f = flags.value
    rows, cols, pairs, consts = values
    nb = len(spec.batch)
    m_local = cols[0].shape[nb]
    block_flags = (row_f, col_f, pair_f, const_f + (False,))

    # A pair's cotangent, squeezed as the backward pass squeezes it, whole along the
    # columns: each slice's share is written at the slice's columns.
    squeezed = spec.squeeze_pairs(select(pairs, pair_f))
    lead = select([sum(s != 1 for s in pb) for pb in spec.pair_batch], pair_f)
    axes = varying_over(values, [c for c in jax.tree.leaves(ct) if not is_zero(c)])
    d_pairs0 = [vary(jnp.zeros(p.shape, accumulation_dtype(p.dtype)), axes) for p in squeezed]

    # Every zero accumulator is made after the residual's last read (attention's delta,
    # rowsum(dO * O)) and reads no residual itself. The slices' ones were made after the
    # residual: they read the float32 output, and where XLA scheduled them after the
    # queries' gradient accumulator (as it did once the softmax saved its log-sum-exp's
    # rounding error too), the output stayed alive beside it, a second query-sized
    # buffer a device.
    last_reads = last_read(row_data(spec, values, residual, ct))

    def pair_share(g, p, k, width):
        # the slice's pair cotangent without the backward pass's padding
        limits = list(g.shape)
        limits[k] = min(g.shape[k], p.shape[k])
        limits[k + 1] = min(g.shape[k + 1], width)
        return lax.slice(g, (0,) * g.ndim, tuple(limits))

    def sub_ring(carry, start, width):
        """The slice ``[start, start + width)`` of every device's block round the ring;
        its cotangent, complete once home, written into the block's."""
        d_home, d_rows, d_pairs, d_consts = carry
        sub = _sliced_spec(spec, width)

        def step(carry, i):
            blk, d_blk, d_rows, d_pairs, d_consts = carry
            in_flight = _rotate(blk, ring)
            offset = _block_offset(ring, m_local, i) + start
            res_b = spec.reduction.localize(residual, offset)
            d_rows, d_blk, d_pair_blk, d_consts = backward(
                sub,
                (rows, blk, _pair_columns(pairs, nb, offset, width), [*consts, offset]),
                res_b,
                block_flags,
                ct,
                running=(d_rows, d_blk, None, d_consts),
            )
            d_pairs = [
                add_block(acc, pair_share(g, p, k, width), (0, offset), k)
                for acc, g, p, k in zip(d_pairs, d_pair_blk, squeezed, lead)
            ]
            # d_blk follows its slice
            return (in_flight, _rotate(d_blk, ring), d_rows, d_pairs, d_consts), None

        blk = [lax.dynamic_slice_in_dim(c, start, width, axis=nb) for c in cols]
        C = sub.tiles.backward_cols
        d_blk = made_after(
            [padded_zeros(a, C, accumulation_dtype(a.dtype), nb) for a in select(blk, col_f)],
            last_reads,
        )
        init = (blk, d_blk, d_rows, d_pairs, d_consts)
        (_, d_blk, d_rows, d_pairs, d_consts), _ = lax.scan(step, init, jnp.arange(ring.size))
        if d_home is None:
            # The block's cotangent, made after the first slice's cotangent. Made after
            # the residual instead, its zeros were still computed only here, but from
            # the residual, which kept attention's float32 output alive through the
            # first slice's ring.
            d_home = made_after([jnp.zeros(a.shape, a.dtype) for a in select(cols, col_f)], d_blk)
        d_home = [
            lax.dynamic_update_slice_in_dim(
                h, lax.slice_in_dim(d, 0, width, axis=nb).astype(h.dtype), start, axis=nb
            )
            for h, d in zip(d_home, d_blk)
        ]
        return d_home, d_rows, d_pairs, d_consts

    d_rows, d_pairs = made_after(
        (
            [jnp.zeros(a.shape, accumulation_dtype(a.dtype)) for a in select(rows, row_f)],
            d_pairs0,
        ),
        last_reads,
    )
    carry = (None, d_rows, d_pairs, accumulators(select(consts, const_f)))
    d_home, d_rows, d_pairs, d_consts = _over_slices(sub_ring, carry, spec, m_local)
    primal_pairs = select(pairs, pair_f)
    d_pairs = [
        d.astype(p.dtype).reshape(p.shape)
        for d, p in zip(psum_replicated(d_pairs, primal_pairs), primal_pairs)
    ]

    def finish(cts, group, f, chunks=None):
        if chunks is not None:
            cts = [lax.slice_in_dim(c, 0, chunks.length, axis=nb) for c in cts]
        return cotangents(f, [c.astype(p.dtype) for c, p in zip(cts, select(group, f))])

    return (
        finish(d_rows, rows, row_f),
        finish(d_home, cols, col_f),
        cotangents(pair_f, d_pairs),
        finish(d_consts, consts, const_f),
    )


ring_core.defvjp(_ring_core_fwd, _ring_core_bwd)
