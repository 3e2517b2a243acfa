"""Tests for memwise.chunked: values and gradients against dense JAX, memory bounds from
compiled_memory at two sizes, input validation, and 4-device sharded runs (subprocess)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import memwise as mw
from memwise import chunked
from memwise.measure import compiled_memory

from _multidevice import run_on_devices



@pytest.fixture(autouse=True, scope="module")
def _float64_in_this_module():
    # Scoped to this module: a global jax_enable_x64 would change every other module's
    # dtypes (and OTT comparisons' iteration counts) once pytest collects this file.
    with jax.enable_x64(True):
        yield

MiB = 2**20


def _dense(fn, x, y, reduce, weights=None, axis=1):
    m = jax.vmap(jax.vmap(fn, (None, 0)), (0, None))(x, y)
    if axis == 0:
        m = m.T
    if reduce == "sum":
        return m if weights is None else m * weights[None]
    return m if weights is None else m + weights[None]


def dense_reduce(fn, x, y, reduce, weights=None, axis=1):
    m = _dense(fn, x, y, reduce, weights, axis)
    return {
        "sum": lambda: jnp.sum(m, 1),
        "logsumexp": lambda: jax.nn.logsumexp(m, 1),
        "max": lambda: jnp.max(m, 1),
        "min": lambda: jnp.min(m, 1),
    }[reduce]()


def _close(a, b, dtype):
    tol = 1e-10 if dtype == jnp.float64 else 2e-4
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


# --------------------------------------------------------------------------------------
# The chunking helper


def test_chunking_pads_edge_and_masks():
    c = chunked.chunking(10, 4)
    assert (c.n_chunks, c.padded, c.ragged) == (3, 12, True)
    parts = c.split(jnp.arange(10.0))
    assert parts.shape == (3, 4)
    np.testing.assert_array_equal(parts[-1], [8, 9, 9, 9])
    np.testing.assert_array_equal(c.mask()[-1], [True, True, False, False])
    np.testing.assert_array_equal(c.merge(parts), np.arange(10.0))
    block = c.block(jnp.arange(10.0), jnp.asarray(8))
    np.testing.assert_array_equal(block[:2], [8, 9])


def test_tiling_forms_and_auto_knob():
    rows, cols = chunked.tiling(100, 50, (16, 64))
    assert (rows.size, cols.size) == (16, 50)
    rows, cols = chunked.tiling(100, 50, 8)
    assert (rows.size, cols.size) == (8, 8)
    from memwise import knobs

    with knobs.recording() as recorded:
        rows, cols = chunked.tiling(20_000, 20_000, "auto", pair_bytes=64)
    assert recorded[0].kind == "chunk_size" and recorded[0].default == (rows.size, cols.size)
    assert rows.size * cols.size * 64 <= 2 * chunked.TILE_BYTES
    costs = recorded[0].cost
    assert all(a <= b for a, b in zip(costs, costs[1:]))


@pytest.mark.parametrize("bad", [0, -3, (0, 4), (4, -1)])
def test_chunk_size_must_be_positive(bad):
    with pytest.raises(ValueError, match="chunk_size"):
        mw.pairwise_reduce(lambda a, b: a @ b, jnp.ones((4, 2)), jnp.ones((4, 2)),
                           chunk_size=bad)
    if isinstance(bad, int):
        with pytest.raises(ValueError, match="chunk_size"):
            mw.chunked_map(jnp.sin, jnp.ones(4), chunk_size=bad)


def test_bad_inputs_have_clear_errors():
    x, y = jnp.ones((4, 3)), jnp.ones((5, 2))
    with pytest.raises(ValueError, match="trailing shapes"):
        mw.pairwise_reduce(lambda a, b: jnp.sum((a - b) ** 2), x, y, chunk_size=2)
    with pytest.raises(ValueError, match="reduce must be one of"):
        mw.pairwise_reduce(lambda a, b: a @ b, x, x, reduce="mean", chunk_size=2)
    with pytest.raises(ValueError, match="weights must have shape"):
        mw.pairwise_reduce(lambda a, b: a @ b, x, x, weights=jnp.ones(3), chunk_size=2)
    with pytest.raises(ValueError, match="axis"):
        mw.pairwise_reduce(lambda a, b: a @ b, x, x, axis=2, chunk_size=2)
    with pytest.raises(ValueError, match="leading lengths"):
        mw.chunked_sum(lambda t: t[0] + t[1], (jnp.ones(3), jnp.ones(4)), chunk_size=2)
    with pytest.raises(TypeError, match="chunk_size"):
        mw.chunked_sum(jnp.sin, jnp.ones(3), chunk_size=1.5)


# --------------------------------------------------------------------------------------
# pairwise_reduce: values and gradients equal dense


@settings(max_examples=3, deadline=None)
@given(
    n=st.integers(1, 9), m=st.integers(1, 9), d=st.integers(1, 3),
    rows=st.integers(1, 5), cols=st.integers(1, 5),
    reduce=st.sampled_from(["sum", "logsumexp", "max", "min"]),
    axis=st.sampled_from([0, 1]),
    dtype=st.sampled_from([jnp.float32, jnp.float64]),
    weighted=st.booleans(), seed=st.integers(0, 2**16),
)
def test_pairwise_matches_dense(n, m, d, rows, cols, reduce, axis, dtype, weighted, seed):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    x = jax.random.normal(keys[0], (n, d), dtype)
    y = jax.random.normal(keys[1], (m, d), dtype)
    scale = jnp.asarray(0.7, dtype)
    weighted = weighted and reduce in ("sum", "logsumexp")
    w = jax.random.normal(keys[2], ((n if axis == 0 else m),), dtype) if weighted else None

    def ours(x, y, w, scale):
        return mw.pairwise_reduce(lambda a, b: -scale * jnp.sum((a - b) ** 2), x, y,
                                  reduce=reduce, weights=w, chunk_size=(rows, cols), axis=axis)

    def dense(x, y, w, scale):
        return dense_reduce(lambda a, b: -scale * jnp.sum((a - b) ** 2), x, y, reduce, w, axis)

    _close(ours(x, y, w, scale), dense(x, y, w, scale), dtype)
    argnums = (0, 1, 3) + ((2,) if weighted else ())
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))  # noqa: E731
    for g1, g2 in zip(jax.grad(loss(ours), argnums)(x, y, w, scale),
                      jax.grad(loss(dense), argnums)(x, y, w, scale)):
        _close(g1, g2, dtype)


def test_pairwise_pytree_points_and_vector_weights():
    keys = jax.random.split(jax.random.PRNGKey(1), 4)
    x = {"p": jax.random.normal(keys[0], (7, 2)), "s": jax.random.uniform(keys[1], (7,))}
    y = {"p": jax.random.normal(keys[2], (5, 2)), "s": jnp.linspace(0.5, 1.0, 5)}
    w = jax.random.normal(keys[3], (5, 3))

    def kernel(a, b):
        return jnp.exp(-jnp.sum((a["p"] - b["p"]) ** 2) * a["s"] * b["s"])

    def ours(x, y, w):
        return mw.pairwise_reduce(kernel, x, y, weights=w, chunk_size=(3, 2))

    def dense(x, y, w):
        return jax.vmap(jax.vmap(kernel, (None, 0)), (0, None))(x, y) @ w

    assert ours(x, y, w).shape == (7, 3)
    _close(ours(x, y, w), dense(x, y, w), jnp.float64)
    loss = lambda f: lambda *a: jnp.sum(f(*a) ** 2)  # noqa: E731
    g1, g2 = jax.grad(loss(ours), (0, 1, 2))(x, y, w), jax.grad(loss(dense), (0, 1, 2))(x, y, w)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        _close(a, b, jnp.float64)


def test_argmax_argmin_and_jit_vmap():
    x = jax.random.normal(jax.random.PRNGKey(2), (3, 11, 2))
    y = jax.random.normal(jax.random.PRNGKey(3), (9, 2))
    fn = lambda a, b: a @ b  # noqa: E731
    f = jax.jit(jax.vmap(lambda x: mw.pairwise_reduce(fn, x, y, reduce="argmax", chunk_size=4)))
    np.testing.assert_array_equal(f(x), jnp.argmax(x @ y.T, -1))
    am = mw.pairwise_reduce(fn, x[0], y, reduce="argmin", chunk_size=(4, 2))
    np.testing.assert_array_equal(am, jnp.argmin(x[0] @ y.T, -1))
    g = jax.vmap(jax.grad(lambda x: jnp.sum(
        mw.pairwise_reduce(fn, x, y, reduce="logsumexp", chunk_size=4))))(x)
    g_dense = jax.vmap(jax.grad(lambda x: jnp.sum(jax.nn.logsumexp(x @ y.T, 1))))(x)
    _close(g, g_dense, jnp.float64)


def test_logsumexp_masks_with_minus_inf_log_weights():
    x = jax.random.normal(jax.random.PRNGKey(4), (6, 2))
    logw = jnp.array([0.0, -jnp.inf, 1.0, -jnp.inf, 0.5])
    y = jax.random.normal(jax.random.PRNGKey(5), (5, 2))
    f = lambda x: mw.pairwise_reduce(lambda a, b: a @ b, x, y, reduce="logsumexp",  # noqa: E731
                                     weights=logw, chunk_size=2)
    d = lambda x: jax.nn.logsumexp(x @ y.T + logw, 1)  # noqa: E731
    _close(f(x), d(x), jnp.float64)
    _close(jax.grad(lambda x: jnp.sum(f(x)))(x), jax.grad(lambda x: jnp.sum(d(x)))(x),
           jnp.float64)


# --------------------------------------------------------------------------------------
# chunked_map / chunked_sum


@settings(max_examples=2, deadline=None)
@given(n=st.integers(1, 12), chunk=st.integers(1, 6), dtype=st.sampled_from([jnp.float32, jnp.float64]))
def test_chunked_map_and_sum_match_dense(n, chunk, dtype):
    xs = {"a": jnp.linspace(-1, 1, n * 3, dtype=dtype).reshape(n, 3), "i": jnp.arange(n)}
    W = jnp.eye(3, dtype=dtype) * 0.5 + 0.1

    def f(W):
        return lambda t: {"h": jnp.tanh(W @ t["a"]) * (t["i"] % 2 + 1), "s": jnp.sum(t["a"] ** 2)}

    def loss_map(xs, W):
        out = mw.chunked_map(f(W), xs, chunk_size=chunk)
        return jnp.sum(out["h"] ** 2) + jnp.sum(jnp.sin(out["s"]))

    def loss_sum(xs, W):
        out = mw.chunked_sum(f(W), xs, chunk_size=chunk)
        return jnp.sum(out["h"] ** 3) + jnp.sin(out["s"])

    def dense_map(xs, W):
        out = jax.vmap(f(W))(xs)
        return jnp.sum(out["h"] ** 2) + jnp.sum(jnp.sin(out["s"]))

    def dense_sum(xs, W):
        out = jax.tree.map(lambda a: jnp.sum(a, 0), jax.vmap(f(W))(xs))
        return jnp.sum(out["h"] ** 3) + jnp.sin(out["s"])

    for ours, dense in [(loss_map, dense_map), (loss_sum, dense_sum)]:
        _close(ours(xs, W), dense(xs, W), dtype)
        g1 = jax.grad(lambda a, W: ours({"a": a, "i": xs["i"]}, W), (0, 1))(xs["a"], W)
        g2 = jax.grad(lambda a, W: dense({"a": a, "i": xs["i"]}, W), (0, 1))(xs["a"], W)
        for a, b in zip(g1, g2):
            _close(a, b, dtype)


def test_forward_mode_raises_type_error():
    with pytest.raises(TypeError):
        jax.jvp(lambda x: mw.chunked_sum(jnp.sin, x, chunk_size=2), (jnp.ones(3),),
                (jnp.ones(3),))


# --------------------------------------------------------------------------------------
# Memory: compiled, never run


def _lse_loss(x, y, chunk_size):
    return jnp.sum(mw.pairwise_reduce(lambda a, b: -jnp.sum((a - b) ** 2), x, y,
                                      reduce="logsumexp", chunk_size=chunk_size))


@pytest.mark.parametrize("chunk_size", ["auto", (1024, 1024)])
def test_gradient_memory_is_tiled_at_20k(chunk_size):
    f = functools.partial(_lse_loss, chunk_size=chunk_size)
    temps = {}
    for n in (20_000, 40_000):
        pts = jax.ShapeDtypeStruct((n, 2), jnp.float32)
        fwd = compiled_memory(f, pts, pts)
        grad = compiled_memory(f, pts, pts, grad=True, argnums=(0, 1))
        temps[n] = grad.temp_bytes
        assert grad.temp_bytes <= 2 * fwd.temp_bytes, (n, fwd, grad)
        assert grad.temp_bytes < 64 * MiB
    # Doubling n adds only O(n) vectors (padded points, per-row results), never a tile row:
    # a dense f32 20k x 20k matrix would be 1,526 MiB.
    assert temps[40_000] - temps[20_000] < 100 * 20_000


def test_chunked_sum_gradient_memory_flat_in_n():
    W = jax.ShapeDtypeStruct((64, 64), jnp.float32)

    def loss(W, xs):
        return jnp.sum(mw.chunked_sum(lambda x: jnp.tanh(W @ jnp.tanh(W @ x)), xs,
                                      chunk_size=256) ** 2)

    temps = [
        compiled_memory(loss, W, jax.ShapeDtypeStruct((n, 64), jnp.float32), grad=True).temp_bytes
        for n in (4096, 32768)
    ]
    # lax.map-style reverse mode would keep 2 activations of (n, 64) per layer: 16 MiB at 32k.
    assert temps[1] - temps[0] < 64 * (32768 - 4096), temps


# --------------------------------------------------------------------------------------
# Many devices


@pytest.mark.slow
def test_sharded_matches_dense_on_4_devices():
    out = run_on_devices(
        """
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P
        import memwise as mw
        from memwise.measure import compiled_memory
        mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
        x = jax.random.normal(jax.random.PRNGKey(0), (16, 2))
        y = jax.random.normal(jax.random.PRNGKey(1), (10, 2))
        A = jnp.asarray(0.5)
        def dense(x, y, A, red, axis):
            M = -A * jnp.sum((x[:, None] - y[None]) ** 2, -1)
            M = M.T if axis == 0 else M
            return {"sum": jnp.sum, "logsumexp": jax.nn.logsumexp, "max": jnp.max,
                    "min": jnp.min}[red](M, axis=1)
        for axis in (1, 0):
            for red in ("sum", "logsumexp", "max", "min"):
                def f(x, y, A):
                    return jnp.sum(jnp.sin(mw.pairwise_reduce(
                        lambda a, b: -A * jnp.sum((a - b) ** 2), x, y, reduce=red,
                        chunk_size=(3, 4), axis=axis, mesh=mesh, axis_name="d")))
                g = lambda x, y, A: jnp.sum(jnp.sin(dense(x, y, A, red, axis)))
                np.testing.assert_allclose(jax.jit(f)(x, y, A), g(x, y, A), rtol=1e-5)
                for a, b in zip(jax.jit(jax.grad(f, (0, 1, 2)))(x, y, A),
                                jax.grad(g, (0, 1, 2))(x, y, A)):
                    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
        # detected from a committed NamedSharding
        xs = jax.device_put(x, NamedSharding(mesh, P("d")))
        np.testing.assert_allclose(
            mw.pairwise_reduce(lambda a, b: a @ b, xs, y, reduce="logsumexp", chunk_size=4),
            jax.nn.logsumexp(x @ y.T, axis=1), rtol=1e-5)
        # inside the user's own shard_map (check_vma on)
        inner = lambda xl, y, A: mw.pairwise_reduce(
            lambda a, b: -A * jnp.sum((a - b) ** 2), xl, y, reduce="logsumexp", chunk_size=3)
        sm = jax.shard_map(inner, mesh=mesh, in_specs=(P("d"), P(), P()), out_specs=P("d"))
        L = lambda x, y, A: jnp.sum(jnp.sin(sm(x, y, A)))
        Ld = lambda x, y, A: jnp.sum(jnp.sin(dense(x, y, A, "logsumexp", 1)))
        for a, b in zip(jax.jit(jax.grad(L, (0, 1, 2)))(x, y, A), jax.grad(Ld, (0, 1, 2))(x, y, A)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
        # chunked_map / chunked_sum
        W = jax.random.normal(jax.random.PRNGKey(3), (2, 2))
        for kind, dense_loss in (
            (mw.chunked_sum, lambda x, W: jnp.sum(jnp.sum(jnp.tanh(x @ W.T), 0) ** 2)),
            (mw.chunked_map, lambda x, W: jnp.sum(jnp.sum(jnp.tanh(x @ W.T), 1) ** 2)),
        ):
            def L(x, W, kind=kind):
                out = kind(lambda a: jnp.tanh(W @ a), x, chunk_size=3, mesh=mesh)
                return jnp.sum((out if kind is mw.chunked_sum else jnp.sum(out, 1)) ** 2)
            for a, b in zip(jax.jit(jax.grad(L, (0, 1)))(x, W), jax.grad(dense_loss, (0, 1))(x, W)):
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
        # per-device memory: the O(n) buffers split 4 ways
        n, feat = 2**16, 32
        pts = jax.ShapeDtypeStruct((n, feat), jnp.float32)
        def loss(x, y, **kw):
            return jnp.sum(mw.pairwise_reduce(lambda a, b: a @ b, x, y, reduce="logsumexp",
                                              chunk_size=(64, 64), **kw))
        one = compiled_memory(loss, pts, pts, grad=True, argnums=(0, 1))
        four = compiled_memory(lambda x, y: loss(x, y, mesh=mesh, axis_name="d"), pts, pts,
                               grad=True, argnums=(0, 1))
        # x's rows split 4 ways per device; y (and its gradient) stays replicated
        x_bytes = y_bytes = n * feat * 4
        assert one.argument_bytes == x_bytes + y_bytes
        assert four.argument_bytes == x_bytes // 4 + y_bytes, four
        assert four.peak_bytes < one.peak_bytes, (one, four)
        print("OK")
        """
    )
    assert "OK" in out


def test_image_shaped_xs_are_not_copied():
    # (n, 28, 28, 1) images: reshaping xs into chunks changed XLA's CPU layout and cost a
    # full copy of xs; chunks are sliced by index instead, so temp is flat in n.
    w = jnp.ones((784, 16))

    def loss(w, xs):
        return mw.chunked_sum(lambda x: jnp.sum(jnp.tanh(x.reshape(-1) @ w)), xs, chunk_size=500)

    temps = [
        compiled_memory(loss, w, jax.ShapeDtypeStruct((n, 28, 28, 1), jnp.float32), grad=True).temp_bytes
        for n in (6_000, 60_000)
    ]
    assert temps[1] - temps[0] < 64 * 1024, temps
