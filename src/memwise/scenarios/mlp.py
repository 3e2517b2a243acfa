"""Scenario ``mlp``: the gradient of a 4-layer tanh MLP, the foundation's worked example.

Not a seed report: it shows what ``memory_report`` says about an ordinary gradient. The
naive program is ``jax.value_and_grad`` of the loss; the memwise program wraps each layer
in ``jax.checkpoint`` with the ``dots_saveable`` policy, so the backward keeps the matmul
outputs and recomputes tanh instead of keeping tanh and its derivative.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from memwise.scenarios import Scenario

SIZES = {
    "default": dict(batch=512, width=512, depth=4),
    "seed": dict(batch=4096, width=2048, depth=4),
}


def init(key: jax.Array, width: int, depth: int) -> list[jax.Array]:
    keys = jax.random.split(key, depth)
    return [jax.random.normal(k, (width, width)) / jnp.sqrt(width) for k in keys]


def loss(params: list[jax.Array], x: jax.Array) -> jax.Array:
    h = x
    for w in params:
        h = jnp.tanh(h @ w)
    return jnp.mean(h**2)


def layer(h: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.tanh(h @ w)


_remat_layer = jax.checkpoint(layer, policy=jax.checkpoint_policies.dots_saveable)


def loss_remat(params: list[jax.Array], x: jax.Array) -> jax.Array:
    h = x
    for w in params:
        h = _remat_layer(h, w)
    return jnp.mean(h**2)


def make(batch: int, width: int, depth: int) -> Scenario:
    params = init(jax.random.PRNGKey(0), width, depth)
    x = jax.random.normal(jax.random.PRNGKey(1), (batch, width))
    return Scenario(
        name="mlp",
        description=f"grad of a {depth}-layer tanh MLP, batch {batch}, width {width}",
        naive=jax.value_and_grad(loss),
        memwise=jax.value_and_grad(loss_remat),
        args=(params, x),
    )
