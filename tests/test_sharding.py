"""Tests for memwise.sharding: chunked primitives on 4 CPU devices (a subprocess) against
dense JAX, detected and explicit meshes, inside a user's shard_map, per-device memory."""

import pytest

from _multidevice import run_on_devices



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
        # arg-extremes over the split points (axis=0): global indices, and the first NaN
        # wins across devices as in jnp.argmax (rows 5 and 13 live on devices 1 and 3)
        xn = x.at[5].set(jnp.nan).at[13].set(jnp.nan)
        for pts in (x, xn):
            M = -jnp.sum((pts[:, None] - y[None]) ** 2, -1)
            for red in ("argmax", "argmin"):
                f = lambda x, y: mw.pairwise_reduce(
                    lambda a, b: -jnp.sum((a - b) ** 2), x, y, reduce=red, axis=0,
                    chunk_size=(3, 4), mesh=mesh, axis_name="d")
                np.testing.assert_array_equal(jax.jit(f)(pts, y), getattr(jnp, red)(M, 0))
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
        # attention with a traced (learned) scale and a shared bias, queries split
        ks = jax.random.split(jax.random.PRNGKey(4), 4)
        q, k, v = (jax.random.normal(kk, (2, 3, 8, 4)) for kk in ks[:3])
        bias = jax.random.normal(ks[3], (8, 8))
        def att(q, k, v, bias, scale, **kw):
            return jnp.sum(jnp.sin(mw.attention(q, k, v, bias=bias, scale=scale, causal=True,
                                                chunk_size=(2, 3), **kw)))
        sharded = lambda *a: att(*a, mesh=mesh, axis_name="d")
        for a, b in zip(jax.jit(jax.grad(sharded, (0, 1, 2, 3, 4)))(q, k, v, bias, 0.3),
                        jax.grad(att, (0, 1, 2, 3, 4))(q, k, v, bias, 0.3)):
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
