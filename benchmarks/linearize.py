"""Benchmark ``linearize``: a training step of a linearized Flax ViT, the problem of
neural-tangents issue 144 (a linearized ViT that cannot train even at batch size 1).

A small Vision Transformer (about 5M parameters, 32x32x3 images, patches of 4): the SGD
step of the model itself, of a closure-based linearization as neural-tangents'
``nt.linearize`` builds it (the linearization point closed over, so ``jit`` makes it a
constant of the program) and of ``mw.linearize`` (the point passed as an argument).
Columns: compiled temp/peak (XLA ``memory_analysis``), the size of the lowered program
text and of the constants baked into it (from the same trace), and wall-time ratios
measured interleaved in one run. The report's failure is the program size: it grows with
the parameter count for the closure, not for ``mw.linearize``.
"""

from __future__ import annotations

import harness
import jax
import numpy as np

from memwise.linearize import linearize
from memwise.scenarios import linearize as scenario

LEARNING_RATE = 0.1


def _sgd(loss):
    def step(params, *args):
        value, grads = jax.value_and_grad(loss)(params, *args)
        return jax.tree_util.tree_map(lambda p, g: p - LEARNING_RATE * g, params, grads), value

    return step


def _program(fn, args) -> dict:
    # Program size and baked-in constants from the trace and the lowering (no compile;
    # the compiled memory comes from the harness's compiled_memory).
    traced = jax.jit(fn).trace(*args)
    constants = sum(int(np.asarray(c).nbytes) for c in traced.jaxpr.consts if hasattr(c, "shape"))
    return {"program bytes": len(traced.lower().as_text()), "constant bytes": constants}


def main(quick: bool = False) -> None:
    size = dict(scenario.SIZES["report"], batch=4 if quick else 16)
    if quick:
        size.update(dim=128, depth=2, mlp=512)
    model, variables, moved, images, labels = scenario.setup(**size)
    n_params = scenario.parameter_count(variables)
    ce = scenario.cross_entropy

    train_f = _sgd(lambda v, x, y: ce(model.apply(v, x), y))
    closure = scenario.closure_linearize(model.apply, variables)
    train_closure = _sgd(lambda v, x, y: ce(closure(v, x), y))
    lin = linearize(model.apply, variables)
    train_lin = _sgd(lambda v, lin, x, y: ce(lin(v, x), y))

    cases = [
        ("train f (model.apply)", train_f, (moved, images, labels)),
        ("closure linearization (nt.linearize-style)", train_closure, (moved, images, labels)),
        ("mw.linearize", train_lin, (moved, lin, images, labels)),
    ]
    variants = [harness.Variant(name, fn, args, _program(fn, args)) for name, fn, args in cases]
    title = (
        f"SGD step of a Flax ViT and of its linearization: {n_params / 1e6:.2f}M parameters "
        f"({n_params * 4 / 2**20:.1f} MiB), depth {size['depth']}, width {size['dim']}, "
        f"batch {size['batch']}"
    )
    table = harness.run_table(title, variants, baseline="train f (model.apply)", quick=quick)
    harness.print_table(table)
    harness.save("linearize", [table], notes=__doc__.split("\n\n")[0], quick=quick)


if __name__ == "__main__":
    harness.cli(main)
