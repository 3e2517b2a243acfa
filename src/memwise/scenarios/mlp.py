"""Scenario ``mlp``: the gradient of a deep residual tanh MLP, layer loop vs ``mw.scan``.

Not from a user report but a worked example of where a gradient's memory goes:
``jax.grad`` of a Python loop over layers keeps every layer's activations (and tanh's
derivative) for the backward pass, O(depth) arrays of batch x width. Stacking the layers'
weights and running them with ``mw.scan`` keeps O(checkpoints) activations instead, at
the cost of recomputing about one extra forward pass (the default checkpoint count).
``memwise report`` on this module's ``naive_factory`` lists those residuals by line.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from memwise.scan import scan
from memwise.scenarios import Scenario

SIZES = {
    "default": dict(depth=64, width=256, batch=1024),
    # No user report behind this one: the larger size that ``--size report`` runs.
    "report": dict(depth=128, width=512, batch=4096),
}


def init(key: jax.Array, depth: int, width: int) -> jax.Array:
    """Stacked weights, shape (depth, width, width)."""
    return jax.random.normal(key, (depth, width, width)) / jnp.sqrt(width)


def layer(h: jax.Array, w: jax.Array) -> jax.Array:
    return h + jnp.tanh(h @ w) / 8


def loss_loop(weights: jax.Array, x: jax.Array) -> jax.Array:
    """What users write: a Python loop over the layers."""
    h = x
    for w in weights:
        h = layer(h, w)
    return jnp.mean(h**2)


def loss_scan(weights: jax.Array, x: jax.Array, checkpoints: int | str | None = None) -> jax.Array:
    """The same network as one ``mw.scan`` over the stacked layers."""
    h, _ = scan(lambda h, w: (layer(h, w), None), x, weights, checkpoints=checkpoints)
    return jnp.mean(h**2)


def make(depth: int, width: int, batch: int) -> Scenario:
    weights = init(jax.random.PRNGKey(0), depth, width)
    x = jax.random.normal(jax.random.PRNGKey(1), (batch, width))
    return Scenario(
        name="mlp",
        description=f"grad of a {depth}-layer residual tanh MLP, width {width}, batch {batch}",
        naive=jax.value_and_grad(loss_loop),
        memwise=jax.value_and_grad(loss_scan),
        args=(weights, x),
        rtol=1e-4,
        atol=1e-5,
    )


def naive_factory():
    """``memwise report memwise.scenarios.mlp:naive_factory --grad``."""
    return loss_loop, make(**SIZES["default"]).args
