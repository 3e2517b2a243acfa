"""Tests for memwise.tiling: chunkings and tilings (forward and backward tiles), the
``"auto"`` knob and its cost model, and that the user's function is traced only for it."""

import jax.numpy as jnp
import numpy as np
import pytest

import memwise as mw
from memwise import knobs, tiling
from memwise.measure import compiled_memory


def test_chunking_slides_the_last_chunk_back_and_masks_its_repeats():
    c = tiling.chunking(10, 4)
    assert (c.n_chunks, c.padded, c.ragged) == (3, 12, True)
    parts = c.split(jnp.arange(10.0))
    assert parts.shape == (3, 4)
    np.testing.assert_array_equal(parts[-1], [6, 7, 8, 9])
    ids, valid = c.chunk_ids(2)
    np.testing.assert_array_equal(ids, [6, 7, 8, 9])
    np.testing.assert_array_equal(valid, [False, False, True, True])
    for k in range(c.n_chunks):  # every chunk is the slice its ids name, by block
        ids, _ = c.chunk_ids(k)
        np.testing.assert_array_equal(c.block(jnp.arange(10.0), k * c.size), ids)
        np.testing.assert_array_equal(parts[k], ids)
    np.testing.assert_array_equal(c.indices(), [0, 1, 2])
    np.testing.assert_array_equal(c.merge(parts), np.arange(10.0))
    even = tiling.chunking(8, 4)
    np.testing.assert_array_equal(even.merge(even.split(jnp.arange(8.0))), np.arange(8.0))
    assert bool(jnp.all(even.chunk_ids(1)[1]))


def test_chunking_takes_a_resolved_chunking_of_the_same_length():
    c = tiling.chunking(10, 4)
    assert tiling.chunking(10, c) is c
    with pytest.raises(ValueError, match="resolved for 10 items"):
        tiling.chunking(12, c)


def test_tiling_forms_and_auto_knob():
    t = tiling.tiling(100, 50, (16, 64))
    assert (t.rows.size, t.cols.size) == (16, 50)
    t = tiling.tiling(100, 50, 8)
    assert (t.rows.size, t.cols.size) == (8, 8)

    with knobs.recording() as recorded:
        t = tiling.tiling(20_000, 20_000, "auto", pair_bytes=64)
    assert recorded[0].kind == "chunk_size" and recorded[0].default == (t.rows.size, t.cols.size)
    assert t.rows.size * t.cols.size * 64 <= 2 * tiling.TILE_BYTES
    costs = recorded[0].cost
    assert all(a <= b for a, b in zip(costs, costs[1:]))


def test_auto_tile_of_a_band_is_one_tile_per_row_block():
    """With a band of width w the default tile is rows x (rows + w): the most rows, down
    to half the usual default's, that keep it within four times the tile budget; a band
    too wide for that, or as wide as the columns, keeps the usual default."""
    usual = tiling.tiling(16_384, 16_384, "auto", pair_bytes=256)
    assert (usual.rows.size, usual.cols.size) == (256, 128)
    band = tiling.tiling(16_384, 16_384, "auto", pair_bytes=256, band=512)
    assert (band.rows.size, band.cols.size) == (128, 640)
    assert band.rows.size * band.cols.size * 256 <= 4 * tiling.TILE_BYTES
    # its backward keeps the usual backward's bytes (half a tile's), and its rows
    assert (band.backward_rows.size, band.backward_cols.size) == (128, 128)
    narrow = tiling.tiling(16_384, 16_384, "auto", pair_bytes=256, band=128)
    assert (narrow.rows.size, narrow.cols.size) == (256, 384)
    for wide in (2_048, 16_384):
        t = tiling.tiling(16_384, 16_384, "auto", pair_bytes=256, band=wide)
        assert (t.rows.size, t.cols.size) == (256, 128)
    with knobs.recording() as recorded:
        tiling.tiling(16_384, 16_384, "auto", pair_bytes=256, band=512)
    assert (128, 640) in recorded[0].candidates


def test_backward_tile_is_explicit():
    t = tiling.tiling(1000, 600, (128, 256))
    # default: half the rows, since a tile's vjp holds about twice its forward
    assert (t.backward_rows.size, t.backward_cols.size) == (64, 256)
    t = tiling.tiling(1000, 600, (128, 256), backward=(32, 512))
    assert (t.backward_rows.size, t.backward_cols.size) == (32, 512)
    assert tiling.tiling(1000, 600, t) is t
    with pytest.raises(ValueError, match="backward"):
        tiling.tiling(1000, 600, 128, backward=(0, 4))


def test_transposed_and_resized_tilings():
    t = tiling.tiling(1000, 600, (128, 256))
    tt = t.transposed()
    assert tt.shape == (600, 1000)
    assert (tt.rows.size, tt.cols.size) == (256, 128)
    # a default backward tile follows the rule in the new orientation
    assert (tt.backward_rows.size, tt.backward_cols.size) == (128, 128)
    explicit = tiling.tiling(1000, 600, (128, 256), backward=(16, 32)).transposed()
    assert (explicit.backward_rows.size, explicit.backward_cols.size) == (32, 16)
    small = tiling.tiling(100, 50, t)  # another shape lends its tile sizes, clipped
    assert small.shape == (100, 50) and (small.rows.size, small.cols.size) == (100, 50)


def test_user_function_is_traced_only_for_auto():
    calls = []

    def estimate():
        calls.append(1)
        return 128

    tiling.tiling(100, 100, (10, 10), pair_bytes=estimate)
    tiling.chunking(100, 10, item_bytes=estimate)
    assert calls == []
    tiling.tiling(100, 100, "auto", pair_bytes=estimate)
    tiling.chunking(100, "auto", item_bytes=estimate)
    assert len(calls) == 2


def test_item_bytes_counts_intermediates_three_times():
    # a (4,) product and its (4,) tanh, float32: 32 bytes traced, 96 with the vjp's share
    assert tiling.item_bytes(lambda x: jnp.tanh(x * 2.0), jnp.ones(4)) == 3 * 32


def test_pair_bytes_counts_what_depends_on_one_point_once_per_row_or_column():
    # The expanded squared distance: two squared norms (one a row's, one a column's) and
    # a dot product. Counted per pair, 64 dimensions made it 1,608 bytes and the auto
    # tile 64 x 64; a tile computes each norm once per row or column.
    def sqdist(a, b):
        return jnp.sum(a * a) + jnp.sum(b * b) - 2.0 * jnp.dot(a, b)

    point = jnp.zeros(64)
    per_pair = tiling.item_bytes(sqdist, point, point)
    split = tiling.pair_bytes(sqdist, point, point)
    assert int(split) < 64 < int(per_pair) // 16
    # a norm: a (64,) square, its sum and a scalar or two; three times that
    assert split.per_row == split.per_col and 3 * 256 < split.per_row <= 3 * (256 + 16)
    n = 8192
    tile = tiling.tiling(n, n, "auto", pair_bytes=split)
    rows, cols = tile.rows.size, tile.cols.size
    assert (
        rows * cols >= 256 * 256 > tiling.tiling(n, n, "auto", pair_bytes=per_pair).rows.size ** 2
    )
    assert int(split) * rows * cols + split.per_row * (rows + cols) <= tiling.TILE_BYTES

    # The model stays an upper bound of what XLA holds for the gradient.
    def loss(x, y):
        return jnp.sum(mw.pairwise_reduce(lambda a, b: -sqdist(a, b), x, y, reduce="logsumexp"))

    pts = jnp.zeros((n, 64))
    grad = compiled_memory(loss, pts, pts, grad=True, argnums=(0, 1))
    assert grad.temp_bytes < tiling.TILE_BYTES, grad


def test_explicit_backward_tile_changes_the_backward_memory_only():
    def loss(x, y, chunk_size):
        return jnp.sum(
            mw.pairwise_reduce(
                lambda a, b: -jnp.sum((a - b) ** 2), x, y, reduce="logsumexp", chunk_size=chunk_size
            )
        )

    import jax

    pts = jax.ShapeDtypeStruct((8192, 16), jnp.float32)
    default = tiling.tiling(8192, 8192, (1024, 1024))
    lean = tiling.tiling(8192, 8192, (1024, 1024), backward=(64, 256))
    fwd = [
        compiled_memory(lambda x, y: loss(x, y, t), pts, pts).temp_bytes for t in (default, lean)
    ]
    grad = [
        compiled_memory(lambda x, y: loss(x, y, t), pts, pts, grad=True, argnums=(0, 1)).temp_bytes
        for t in (default, lean)
    ]
    assert fwd[0] == fwd[1]
    # the default backward tile is 512 x 1024 pairs of 16 floats; the lean one 64 x 256
    assert grad[1] < grad[0] - 8 * 2**20, grad


@pytest.mark.parametrize("bad", [0, -3, (0, 4), (4, -1), (1, 2, 3), "big", 2.5])
def test_bad_tile_sizes_name_the_argument(bad):
    with pytest.raises((ValueError, TypeError), match="chunk_size"):
        tiling.tiling(10, 10, bad)


def _auto_tile_costs(fn, point, n, monkeypatch):
    from memwise import costmodel, knobs
    from memwise import tiling as tiling_lib

    machine = costmodel.Machine(
        "cpu/test", 1e11, ((2**15, 1e11), (2**20, 1e11), (2**25, 1e10)), 1e-7
    )
    monkeypatch.setattr(costmodel, "machine", lambda: machine)
    with knobs.recording() as found:
        tiling_lib.tiling(n, n, "auto", pair_bytes=lambda: tiling_lib.item_bytes(fn, point, point))
    (knob,) = found
    return dict(zip(knob.candidates, knob.cost))


def test_auto_tile_costs_follow_the_roofline(monkeypatch):
    n = 4096
    # memory-bound: a few flops per pair, so a tile in cache beats the largest tiles
    cheap = _auto_tile_costs(lambda a, b: -jnp.sum((a - b) ** 2), jnp.zeros(2), n, monkeypatch)
    multi = {t: c for t, c in cheap.items() if t != (n, n)}
    best = min(multi, key=multi.get)
    largest = max(multi, key=lambda t: t[0] * t[1])
    assert best[0] * best[1] < largest[0] * largest[1] // 16
    assert multi[largest] > 3 * multi[best]
    # compute-bound: a 64 x 64 matrix product per pair, so the largest tile is fastest
    w = jnp.ones((64, 64)) / 64
    heavy = _auto_tile_costs(
        lambda a, b: jnp.sum(jnp.tanh(w @ (a * b))), jnp.zeros(64), n, monkeypatch
    )
    multi = {t: c for t, c in heavy.items() if t != (n, n)}
    largest = max(multi, key=lambda t: t[0] * t[1])
    assert multi[largest] <= 1.05 * min(multi.values())
    # outside fit, "auto" is the default tile and compiles nothing
    from memwise import tiling as tiling_lib

    assert tiling_lib.tiling(
        n, n, "auto", pair_bytes=lambda: tiling_lib.item_bytes(lambda a, b: a @ b, w[0], w[0])
    )
