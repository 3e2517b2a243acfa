"""Tests for memwise.engine: the tile engine's reductions against dense JAX, the backward
pass on its own explicit tile, skipped tiles, and its input checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from memwise.engine import tiled_reduce
from memwise.tiling import tiling


def _scores(xb, yb, _pairs, consts, _rids, _cids):
    return -consts["scale"] * jnp.sum((xb[:, None] - yb[None]) ** 2, -1)


def _dense_scores(x, y, scale):
    return -scale * jnp.sum((x[:, None] - y[None]) ** 2, -1)


@pytest.mark.parametrize("reduce", ["sum", "logsumexp"])
@pytest.mark.parametrize("backward", [None, (2, 3), (7, 11)])
def test_reductions_and_gradients_match_dense_on_any_backward_tile(reduce, backward):
    x = jax.random.normal(jax.random.PRNGKey(0), (13, 2))
    y = jax.random.normal(jax.random.PRNGKey(1), (11, 2))
    tiles = tiling(13, 11, (4, 5), backward=backward)
    dense_reduce = jnp.sum if reduce == "sum" else jax.nn.logsumexp

    def loss(x, y, scale):
        out = tiled_reduce(_scores, x, y, reduce=reduce, tiles=tiles, consts={"scale": scale})
        return jnp.sum(jnp.sin(out))

    def dense(x, y, scale):
        return jnp.sum(jnp.sin(dense_reduce(_dense_scores(x, y, scale), axis=1)))

    np.testing.assert_allclose(loss(x, y, 0.7), dense(x, y, 0.7), rtol=1e-4)
    for a, b in zip(jax.grad(loss, (0, 1, 2))(x, y, 0.7), jax.grad(dense, (0, 1, 2))(x, y, 0.7)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_softmax_reduction_is_attention_with_skipped_tiles():
    q = jax.random.normal(jax.random.PRNGKey(2), (10, 4))
    k = jax.random.normal(jax.random.PRNGKey(3), (10, 4))
    v = jax.random.normal(jax.random.PRNGKey(4), (10, 3))
    tiles = tiling(10, 10, (3, 4), backward=(5, 2))

    def tile_fn(qb, kv, _pairs, _consts, rids, cids):
        s = qb @ kv["k"].T
        return jnp.where(cids[None, :] <= rids[:, None], s, -jnp.inf), kv["v"]

    def live(rids, cids, _consts):
        return cids[0] <= rids[-1]

    def loss(q, k, v):
        out, _ = tiled_reduce(tile_fn, q, {"k": k, "v": v}, reduce="softmax", tiles=tiles,
                              live=live)
        return jnp.sum(out ** 2)

    def dense(q, k, v):
        s = jnp.where(jnp.tril(jnp.ones((10, 10), bool)), q @ k.T, -jnp.inf)
        return jnp.sum((jax.nn.softmax(s, axis=1) @ v) ** 2)

    np.testing.assert_allclose(loss(q, k, v), dense(q, k, v), rtol=1e-5)
    for a, b in zip(jax.grad(loss, (0, 1, 2))(q, k, v), jax.grad(dense, (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_max_reduction_returns_argmax():
    x = jnp.arange(6.0)[:, None]
    y = jnp.array([[0.5], [4.2], [2.0]])
    tiles = tiling(6, 3, 2)
    value, arg = tiled_reduce(_scores, x, y, reduce="max", tiles=tiles, consts={"scale": 1.0})
    dense = _dense_scores(x, y, 1.0)
    np.testing.assert_allclose(value, jnp.max(dense, 1))
    np.testing.assert_array_equal(arg, jnp.argmax(dense, 1))


def test_engine_checks_its_tiles():
    x = jnp.ones((6, 2))
    with pytest.raises(TypeError, match="tiles must be a memwise.tiling.Tiling"):
        tiled_reduce(_scores, x, x, reduce="sum", tiles=(2, 2), consts={"scale": 1.0})
    with pytest.raises(ValueError, match="resolved for"):
        tiled_reduce(_scores, x, x, reduce="sum", tiles=tiling(5, 6, 2), consts={"scale": 1.0})
    with pytest.raises(ValueError, match="reduce must be one of"):
        tiled_reduce(_scores, x, x, reduce="mean", tiles=tiling(6, 6, 2))
