"""Benchmark ``mlp``: the gradient of a deep residual tanh MLP, plain JAX vs ``mw.scan``.

The layer loop users write, the same as ``lax.scan``, ``lax.scan`` with per-step
``jax.checkpoint`` (one carry per layer still kept), and ``mw.scan`` at its default
checkpoint count and at 4 checkpoints, measured in one run.
"""

from __future__ import annotations

import harness
import jax
import jax.numpy as jnp

from memwise.scenarios import mlp


def _lax_scan(remat: bool):
    step = lambda h, w: (mlp.layer(h, w), None)  # noqa: E731
    if remat:
        step = jax.checkpoint(step)

    def loss(weights, x):
        h, _ = jax.lax.scan(step, x, weights)
        return jnp.mean(h**2)

    return jax.value_and_grad(loss)


def main(quick: bool = False) -> None:
    size = mlp.SIZES["default"]
    scenario = mlp.make(**size)
    args = scenario.args
    variants = [
        harness.Variant("layer loop + jax.grad", scenario.naive, args),
        harness.Variant("lax.scan", _lax_scan(remat=False), args),
        harness.Variant("lax.scan(jax.checkpoint(layer))", _lax_scan(remat=True), args),
        harness.Variant("mw.scan (default checkpoints)", scenario.memwise, args),
        harness.Variant(
            "mw.scan (4 checkpoints)",
            jax.value_and_grad(lambda w, x: mlp.loss_scan(w, x, checkpoints=4)),
            args,
        ),
    ]
    table = harness.run_table(
        scenario.description, variants, baseline="layer loop + jax.grad", quick=quick
    )
    harness.print_table(table)
    harness.save("mlp", [table], notes=mlp.__doc__.split("\n\n")[0], quick=quick)


if __name__ == "__main__":
    harness.cli(main)
