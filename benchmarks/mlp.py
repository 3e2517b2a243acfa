"""Benchmark ``mlp``: the gradient of a deep tanh MLP, plain JAX vs the memwise program.

The scenario's naive and memwise programs, plus the two per-layer ``jax.checkpoint``
policies JAX users reach for first, measured in one run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import harness
from memwise.scenarios import mlp


def _per_layer(policy):
    layer = jax.checkpoint(mlp.layer, policy=policy)

    def loss(params, x):
        h = x
        for w in params:
            h = layer(h, w)
        return jnp.mean(h**2)

    return jax.value_and_grad(loss)


def main(quick: bool = False) -> None:
    size = dict(mlp.SIZES["default"])
    scenario = mlp.make(**size)
    args = scenario.args
    variants = [
        harness.Variant("jax.grad", scenario.naive, args),
        harness.Variant("checkpoint per layer (dots_saveable)",
                        _per_layer(jax.checkpoint_policies.dots_saveable), args),
        harness.Variant("checkpoint per layer (nothing_saveable)",
                        _per_layer(jax.checkpoint_policies.nothing_saveable), args),
        harness.Variant("memwise", scenario.memwise, args),
    ]
    table = harness.run_table(scenario.description, variants, baseline="jax.grad", quick=quick)
    harness.print_table(table)
    harness.save("mlp", [table], notes=mlp.__doc__.splitlines()[0], quick=quick)


if __name__ == "__main__":
    harness.cli(main)
