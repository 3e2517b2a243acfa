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

jax.config.update("jax_enable_x64", True)


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

    np.testing.assert_allclose(ours(q, k, v, bias), dense(q, k, v, bias), rtol=tol, atol=tol)
    argnums = (0, 1, 2) + ((3,) if use_bias else ())
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))  # noqa: E731
    for a, b in zip(jax.grad(loss(ours), argnums)(q, k, v, bias),
                    jax.grad(loss(dense), argnums)(q, k, v, bias)):
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
