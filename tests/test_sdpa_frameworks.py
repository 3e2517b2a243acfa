"""mw.flax_attention_fn inside Flax's own attention layers (linen and NNX): the same
outputs and parameter gradients as Flax's attention without dropout, and a training
step of a transformer block with dropout."""

from __future__ import annotations

import _draw
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import memwise as mw


def _close_trees(a, b, atol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(x, y, atol=atol)


@pytest.mark.slow
def test_linen_attention_fn_matches_flax_and_trains():
    x = _draw.normal(jax.random.key(0), (2, 37, 16))
    mask = nn.make_causal_mask(jnp.ones((2, 37)))

    def layer(fn, rate=0.0):
        return nn.MultiHeadDotProductAttention(
            num_heads=4, qkv_features=32, attention_fn=fn, dropout_rate=rate
        )

    params = layer(nn.dot_product_attention).init(jax.random.key(1), x, mask=mask)

    def loss(params, fn):
        return jnp.sum(layer(fn).apply(params, x, mask=mask) ** 2)

    # compiled (eager, each operation of the layer and the tile loops compiled alone)
    value_and_grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    ours, d_ours = value_and_grad(params, mw.flax_attention_fn)
    theirs, d_theirs = value_and_grad(params, nn.dot_product_attention)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    _close_trees(d_ours, d_theirs, atol=1e-4)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            h = layer(mw.flax_attention_fn, rate=0.1)(
                nn.LayerNorm()(x), mask=mask, deterministic=not train
            )
            x = x + h
            return x + nn.Dense(16)(nn.gelu(nn.Dense(64)(nn.LayerNorm()(x))))

    block = Block()
    params = block.init(jax.random.key(2), x, train=False)
    opt = optax.adam(1e-2)
    state = opt.init(params)

    @jax.jit
    def step(params, state, rng):
        def loss(p):
            return jnp.mean((block.apply(p, x, train=True, rngs={"dropout": rng}) - x[::-1]) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        updates, state = opt.update(grads, state)
        return optax.apply_updates(params, updates), state, value

    losses = []
    for i in range(5):
        params, state, value = step(params, state, jax.random.key(10 + i))
        losses.append(float(value))
    assert np.isfinite(losses).all() and losses[-1] < losses[0], losses


@pytest.mark.slow
def test_nnx_attention_fn_matches_flax_and_trains():
    x = _draw.normal(jax.random.key(0), (2, 29, 16))

    def layer(fn, rate=0.0):
        return nnx.MultiHeadAttention(
            num_heads=4,
            in_features=16,
            qkv_features=32,
            attention_fn=fn,
            dropout_rate=rate,
            decode=False,
            rngs=nnx.Rngs(0),
        )

    ours_layer, theirs_layer = layer(mw.flax_attention_fn), layer(nnx.dot_product_attention)
    mask = nnx.make_causal_mask(jnp.ones((2, 29)))

    def loss(model):
        return jnp.sum(model(x, mask=mask, deterministic=True) ** 2)

    # compiled (eager, each operation of the layer and the tile loops compiled alone)
    ours, d_ours = nnx.jit(nnx.value_and_grad(loss))(ours_layer)
    theirs, d_theirs = nnx.jit(nnx.value_and_grad(loss))(theirs_layer)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    _close_trees(nnx.state(d_ours), nnx.state(d_theirs), atol=1e-4)

    model = layer(mw.flax_attention_fn, rate=0.1)
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    rngs = nnx.Rngs(dropout=3)

    @nnx.jit
    def step(model, optimizer, rngs):
        def loss(model, rngs):
            out = model(x, mask=mask, deterministic=False, rngs=rngs)
            return jnp.mean((out - x[::-1]) ** 2)

        value, grads = nnx.value_and_grad(loss)(model, rngs)
        optimizer.update(model, grads)
        return value

    losses = [float(step(model, optimizer, rngs)) for _ in range(5)]
    assert np.isfinite(losses).all() and losses[-1] < losses[0], losses


def test_segment_ids_bound_to_a_flax_layer_match_flax_with_the_segment_mask():
    # Packed sequences: the ids bound with functools.partial (linen builds the layer in
    # the parent's compact call, NNX sets the layer's attention_fn) give what Flax's own
    # attention gives with the B x T x T mask the ids stand for.
    import functools

    x = _draw.normal(jax.random.key(1), (2, 23, 16))
    ids = jnp.array([[0] * 9 + [1] * 14, [0] * 4 + [1] * 10 + [2] * 9])
    mask = nn.make_attention_mask(ids, ids, jnp.equal)
    bound = functools.partial(mw.flax_attention_fn, q_segment_ids=ids)

    class Block(nn.Module):
        fn: object

        @nn.compact
        def __call__(self, x, mask=None):
            return nn.MultiHeadDotProductAttention(num_heads=4, attention_fn=self.fn)(x, mask=mask)

    # compiled (eagerly, each operation of the tile loops compiled on its own)
    params = jax.jit(Block(bound).init)(jax.random.key(0), x)
    ours = jax.jit(Block(bound).apply)(params, x)
    theirs = Block(nn.dot_product_attention).apply(params, x, mask=mask)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)

    layer = nnx.MultiHeadAttention(num_heads=4, in_features=16, decode=False, rngs=nnx.Rngs(0))
    theirs = layer(x, mask=mask)
    layer.attention_fn = bound
    np.testing.assert_allclose(
        nnx.jit(lambda layer, x: layer(x))(layer, x), theirs, rtol=1e-5, atol=1e-6
    )
