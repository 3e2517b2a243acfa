"""Scenario ``linearize``: training a linearized Vision Transformer.

The neural-tangents issue 144 report: the user linearizes a Flax ViT with
neural-tangents' ``nt.linearize(vit_apply, params)`` and trains the linear model; every
step fails with "Failed to load in-memory CUBIN: out of memory", even at batch size 1.
``nt.linearize`` returns a closure over ``params``, so ``jit`` embeds all the weights in
the compiled program as constants. The naive program here is that closure (``f(p0, x) +
jvp(f, p0, p - p0)`` with ``p0`` closed over); the memwise program is the same loss
through :func:`memwise.linearize`, whose result is a pytree passed to the step as an
argument. Both compute the loss and its gradient w.r.t. the new parameters; only the
program size differs (and the naive one grows with the model).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from memwise.linearize import linearize
from memwise.scenarios import Scenario

SIZES = {
    "default": dict(image=16, patch=4, dim=32, depth=2, heads=2, mlp=64, batch=8),
    # About 5M parameters.
    "report": dict(image=32, patch=4, dim=256, depth=6, heads=8, mlp=1024, batch=64),
}

CLASSES = 10


def vit(image: int, patch: int, dim: int, depth: int, heads: int, mlp: int) -> Any:
    """A small Flax linen ViT: patch embedding, pre-norm blocks, mean pooling, head."""
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            y = nn.LayerNorm()(x)
            x = x + nn.MultiHeadDotProductAttention(num_heads=heads)(y, y)
            y = nn.LayerNorm()(x)
            return x + nn.Dense(dim)(nn.gelu(nn.Dense(mlp)(y)))

    class ViT(nn.Module):
        @nn.compact
        def __call__(self, images):
            x = nn.Conv(dim, (patch, patch), strides=(patch, patch))(images)
            x = x.reshape(x.shape[0], -1, dim)
            position = self.param("position", nn.initializers.normal(0.02), x.shape[1:])
            x = x + position
            for _ in range(depth):
                x = Block()(x)
            return nn.Dense(CLASSES)(nn.LayerNorm()(x).mean(axis=1))

    del image
    return ViT()


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * labels, axis=1))


def closure_linearize(f, params):
    """neural-tangents' ``linearize``: a closure over the linearization point."""

    def f_lin(new_params, *inputs):
        delta = jax.tree_util.tree_map(jnp.subtract, new_params, params)
        out, tangent = jax.jvp(lambda p: f(p, *inputs), (params,), (delta,))
        return jax.tree_util.tree_map(jnp.add, out, tangent)

    return f_lin


def setup(
    image: int, patch: int, dim: int, depth: int, heads: int, mlp: int, batch: int
) -> tuple[Any, Any, Any, jax.Array, jax.Array]:
    """(model, variables, shifted variables, images, labels)."""
    model = vit(image, patch, dim, depth, heads, mlp)
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    images = jax.random.normal(keys[0], (batch, image, image, 3))
    labels = jax.nn.one_hot(jax.random.randint(keys[1], (batch,), 0, CLASSES), CLASSES)
    variables = model.init(keys[2], images[:1])
    noise = jax.tree_util.tree_map(
        lambda a: 0.01 * jax.random.normal(keys[3], a.shape, a.dtype), variables
    )
    moved = jax.tree_util.tree_map(jnp.add, variables, noise)
    return model, variables, moved, images, labels


def parameter_count(variables: Any) -> int:
    return sum(a.size for a in jax.tree_util.tree_leaves(variables))


def make(**size: int) -> Scenario:
    model, variables, moved, images, labels = setup(**size)
    closure = closure_linearize(model.apply, variables)
    lin = linearize(model.apply, variables)

    def naive(new_variables, lin, images, labels):
        del lin  # the closure already holds the linearization point
        return jax.value_and_grad(lambda v: cross_entropy(closure(v, images), labels))(
            new_variables
        )

    def memwise(new_variables, lin, images, labels):
        return jax.value_and_grad(lambda v: cross_entropy(lin(v, images), labels))(new_variables)

    return Scenario(
        name="linearize",
        description=(
            f"training step of a linearized Flax ViT ({parameter_count(variables) / 1e6:.2f}M "
            f"parameters, depth {size['depth']}, width {size['dim']}), batch {size['batch']}; "
            f"the naive program bakes the {parameter_count(variables) * 4 / 2**20:.2f} MiB "
            "of parameters into itself as constants, what made the original fail to load "
            "at any batch size; memwise passes them as an argument (so its peak counts "
            "them, and the two peaks are alike)"
        ),
        naive=naive,
        memwise=memwise,
        args=(moved, lin, images, labels),
        rtol=1e-4,
        atol=1e-6,
        headline="constants",
    )
