"""Tests for memwise.attention: values and gradients against dense softmax attention and
jax.nn.dot_product_attention; compiled gradient memory at two sequence lengths."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import memwise as mw
from memwise.measure import compiled_memory

from _multidevice import run_on_devices



@pytest.fixture(autouse=True, scope="module")
def _float64_in_this_module():
    # Scoped to this module: a global jax_enable_x64 would change every other module's
    # dtypes (and OTT comparisons' iteration counts) once pytest collects this file.
    with jax.enable_x64(True):
        yield


def dense_attention(q, k, v, mask=None, bias=None, causal=False):
    s = jnp.einsum("...qd,...kd->...qk", q, k) / jnp.sqrt(q.shape[-1])
    if bias is not None:
        s = s + bias
    keep = jnp.ones(s.shape[-2:], bool) if mask is None else mask
    if causal:
        keep = keep & jnp.tril(jnp.ones(s.shape[-2:], bool))
    s = jnp.where(keep, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.where(jnp.isnan(p), 0.0, p) @ v


@settings(max_examples=2, deadline=None)
@given(
    lq=st.integers(1, 9), lk=st.integers(1, 9), rows=st.integers(1, 4), cols=st.integers(1, 4),
    causal=st.booleans(), use_mask=st.booleans(), use_bias=st.booleans(),
    dtype=st.sampled_from([jnp.float32, jnp.float64]), seed=st.integers(0, 999),
)
def test_matches_dense(lq, lk, rows, cols, causal, use_mask, use_bias, dtype, seed):
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(keys[0], (2, 2, lq, 3), dtype)
    k = jax.random.normal(keys[1], (2, 2, lk, 3), dtype)
    v = jax.random.normal(keys[2], (2, 2, lk, 4), dtype)
    mask = jax.random.bernoulli(keys[3], 0.7, (lq, lk)) if use_mask else None
    bias = jax.random.normal(keys[4], (2, 1, lq, lk), dtype) if use_bias else None
    tol = 1e-10 if dtype == jnp.float64 else 3e-5

    def ours(q, k, v, bias):
        return mw.attention(q, k, v, mask=mask, bias=bias, causal=causal, chunk_size=(rows, cols))

    def dense(q, k, v, bias):
        return dense_attention(q, k, v, mask, bias, causal)

    argnums = (0, 1, 2) + ((3,) if use_bias else ())
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))  # noqa: E731
    # One compiled program computing values and gradients (compiling is the cost here).
    both = lambda f: jax.jit(lambda *a: (f(*a), jax.grad(loss(f), argnums)(*a)))  # noqa: E731
    (out, grads), (out_d, grads_d) = both(ours)(q, k, v, bias), both(dense)(q, k, v, bias)
    np.testing.assert_allclose(out, out_d, rtol=tol, atol=tol)
    for a, b in zip(grads, grads_d):
        np.testing.assert_allclose(a, b, rtol=tol * 10, atol=tol * 10)


def test_matches_jax_dot_product_attention():
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(kk, (2, 4, 37, 8), jnp.float32) for kk in keys)
    # jax.nn.dot_product_attention takes (batch, length, heads, dim)
    t = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731
    ref = t(jax.nn.dot_product_attention(t(q), t(k), t(v), is_causal=True))
    np.testing.assert_allclose(mw.attention(q, k, v, causal=True, chunk_size=(8, 16)), ref,
                               rtol=2e-5, atol=2e-5)


def test_gradient_memory_bounded():
    temps = []
    for length in (16_384, 32_768):
        s = jax.ShapeDtypeStruct((1, 1, length, 64), jnp.float32)
        loss = lambda q, k, v: jnp.sum(mw.attention(q, k, v) ** 2)  # noqa: E731
        fwd = compiled_memory(loss, s, s, s)
        grad = compiled_memory(loss, s, s, s, grad=True, argnums=(0, 1, 2))
        assert grad.temp_bytes < 128 * 2**20  # the score matrix alone is 1,024 MiB
        assert grad.temp_bytes <= 2 * fwd.temp_bytes
        temps.append(grad.temp_bytes)
    # doubling L adds O(L d) vectors (q/k/v-sized), not an L x L tile row
    assert temps[1] - temps[0] < 16 * 16_384 * 64 * 4


def test_bad_shapes():
    q = jnp.ones((2, 5, 4))
    with pytest.raises(ValueError, match="feature dim"):
        mw.attention(q, jnp.ones((2, 5, 3)), jnp.ones((2, 5, 3)))
    with pytest.raises(ValueError, match="leading"):
        mw.attention(q, jnp.ones((3, 5, 4)), jnp.ones((3, 5, 4)))
    with pytest.raises(ValueError, match="mask"):
        mw.attention(q, q, q, mask=jnp.ones((4, 4), bool))
    with pytest.raises(ValueError, match="chunk_size"):
        mw.attention(q, q, q, chunk_size=0)


def test_causal_skips_tiles_above_the_diagonal():
    # One row block, 4 column tiles: the skipped tiles must not change values or
    # gradients, including a ragged last tile and Lq != Lk.
    keys = jax.random.split(jax.random.PRNGKey(7), 3)
    q = jax.random.normal(keys[0], (2, 13, 4))
    k = jax.random.normal(keys[1], (2, 17, 4))
    v = jax.random.normal(keys[2], (2, 17, 3))
    f = lambda q, k, v: jnp.sum(mw.attention(q, k, v, causal=True,  # noqa: E731
                                             chunk_size=(4, 5)) ** 2)
    g = lambda q, k, v: jnp.sum(dense_attention(q, k, v, causal=True) ** 2)  # noqa: E731
    vg = jax.jit(jax.value_and_grad(f, (0, 1, 2)))
    (val, grads), (val_d, grads_d) = vg(q, k, v), jax.value_and_grad(g, (0, 1, 2))(q, k, v)
    np.testing.assert_allclose(val, val_d, rtol=1e-10)
    for a, b in zip(grads, grads_d):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-10)
    # the tile loops (forward and backward) hold a conditional: dead tiles are branched
    # around, not computed and masked
    hlo = vg.lower(q, k, v).as_text()
    assert hlo.count("stablehlo.case") + hlo.count("conditional") >= 2


def test_bad_sharding_options():
    q = jnp.ones((2, 4, 8, 4))
    mesh = jax.make_mesh((1,), ("d",))
    with pytest.raises(ValueError, match="feature dim"):
        mw.attention(q, q, q, mesh=mesh, axis_name="d", shard_dim=-1)
    with pytest.raises(ValueError, match="not an axis"):
        mw.attention(q, q, q, mesh=mesh, axis_name="x")
    with pytest.raises(ValueError, match="axis_name needs mesh"):
        mw.attention(q, q, q, axis_name="d")
    with pytest.raises(TypeError, match="shard_dim"):
        mw.attention(q, q, q, mesh=mesh, axis_name="d", shard_dim=1.0)


@pytest.mark.slow
def test_sharded_matches_single_device_on_4_devices():
    out = run_on_devices(
        """
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P
        import memwise as mw
        from memwise.measure import compiled_memory
        mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
        ks = jax.random.split(jax.random.PRNGKey(0), 6)
        B, H, L = 2, 4, 12
        q = jax.random.normal(ks[0], (B, H, L, 8))
        k = jax.random.normal(ks[1], (B, H, L, 8))
        v = jax.random.normal(ks[2], (B, H, L, 5))
        mask = jax.random.bernoulli(ks[3], 0.8, (L, L))
        bias = jax.random.normal(ks[4], (B, 1, L, L))
        for shard_dim in (-2, 1):          # queries split; heads split
            for causal in (False, True):
                def loss(q, k, v, bias, **kw):
                    out = mw.attention(q, k, v, mask=mask, bias=bias, causal=causal,
                                       chunk_size=(2, 5), **kw)
                    return jnp.sum(jnp.sin(out))
                sharded = lambda *a: loss(*a, mesh=mesh, axis_name="d", shard_dim=shard_dim)
                np.testing.assert_allclose(jax.jit(sharded)(q, k, v, bias),
                                           loss(q, k, v, bias), rtol=1e-5)
                for a, b in zip(jax.jit(jax.grad(sharded, (0, 1, 2, 3)))(q, k, v, bias),
                                jax.grad(loss, (0, 1, 2, 3))(q, k, v, bias)):
                    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
        # detected from a concrete q with a NamedSharding over its heads
        qs = jax.device_put(q, NamedSharding(mesh, P(None, "d")))
        np.testing.assert_allclose(mw.attention(qs, k, v, causal=True, chunk_size=4),
                                   mw.attention(q, k, v, causal=True, chunk_size=4),
                                   rtol=1e-5, atol=1e-6)
        # per-device memory of the gradient
        s = jax.ShapeDtypeStruct((1, 4, 4096, 64), jnp.float32)
        def grad_mem(**kw):
            f = lambda q, k, v: jnp.sum(mw.attention(q, k, v, causal=True,
                                                     chunk_size=(256, 256), **kw) ** 2)
            return compiled_memory(f, s, s, s, grad=True, argnums=(0, 1, 2))
        one = grad_mem()
        heads = grad_mem(mesh=mesh, axis_name="d", shard_dim=1)
        rows = grad_mem(mesh=mesh, axis_name="d")
        print("one", one, "heads", heads, "rows", rows)
        assert heads.argument_bytes * 4 == one.argument_bytes, (one, heads)
        assert heads.peak_bytes < 0.35 * one.peak_bytes, (one, heads)
        # queries split: q, the output and dq shrink 4x; k, v and their gradients do not
        assert rows.peak_bytes < one.peak_bytes, (one, rows)
        print("OK")
        """
    )
    assert "OK" in out
