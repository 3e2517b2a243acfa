"""Benchmark ``linearize``: a training step of a linearized Flax ViT, the problem of
neural-tangents issue 144 (a linearized ViT that cannot train even at batch size 1).

A small Vision Transformer (about 5M parameters, 32x32x3 images, patches of 4): the SGD
step of the model itself, of a closure-based linearization as neural-tangents'
``nt.linearize`` builds it (the linearization point closed over, so ``jit`` makes it a
constant of the program) and of ``mw.linearize`` (the point passed as an argument).
Columns: compiled temp/peak (XLA ``memory_analysis``), the size of the lowered program
text and of the constants baked into it (from the same trace), and wall-time ratios
measured interleaved in one run. The report's failure is the program size: it grows with
the parameter count for the closure, not for ``mw.linearize``. Then the report's own
model, compiled only: ViT-B/32 at 384x384 (87.5M parameters), the model the report's
notebook (``vit_jax.ipynb``) fine-tunes on CIFAR-10, at batch 1.
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


def _constants(traced) -> int:
    """Bytes of the constants a traced program bakes in."""
    return sum(int(np.asarray(c).nbytes) for c in traced.jaxpr.consts if hasattr(c, "shape"))


def _program(fn, args) -> dict:
    # Program size and baked-in constants from the trace and the lowering (no compile;
    # the compiled memory comes from the harness's compiled_memory).
    traced = jax.jit(fn).trace(*args)
    return {"program bytes": len(traced.lower().as_text()), "constant bytes": _constants(traced)}


def _steps(size: dict) -> tuple[int, list]:
    """(parameter count, the three SGD steps as (name, fn, args)) for a ViT of ``size``."""
    model, variables, moved, images, labels = scenario.setup(**size)
    ce = scenario.cross_entropy
    closure = scenario.closure_linearize(model.apply, variables)
    lin = linearize(model.apply, variables)
    steps = [
        (
            "train f (model.apply)",
            _sgd(lambda v, x, y: ce(model.apply(v, x), y)),
            (moved, images, labels),
        ),
        (
            "closure linearization (nt.linearize-style)",
            _sgd(lambda v, x, y: ce(closure(v, x), y)),
            (moved, images, labels),
        ),
        ("mw.linearize", _sgd(lambda v, lin, x, y: ce(lin(v, x), y)), (moved, lin, images, labels)),
    ]
    return scenario.parameter_count(variables), steps


# ViT-B/32 at the 384x384 fine-tuning resolution of the report's notebook.
ORIGINAL = dict(image=384, patch=32, dim=768, depth=12, heads=12, mlp=3072, batch=1)


def original_table() -> dict:
    """The three steps at the report's size, compiled only (the program text is not
    printed: the closure's holds every weight). The peak is XLA's own figure where it is
    larger than arguments + outputs + temporaries, as for the closure, whose program
    counts its constants."""
    n_params, steps = _steps(ORIGINAL)
    variants = [
        harness.Variant(
            name, fn, args, {"constants": _constants(jax.jit(fn).trace(*args))}, run=False
        )
        for name, fn, args in steps
    ]
    title = (
        f"the report's model, compiled only: ViT-B/32 at 384x384, {n_params / 1e6:.1f}M "
        f"parameters ({n_params * 4 / 2**20:.0f} MiB), batch 1"
    )
    table = harness.run_table(title, variants, baseline="train f (model.apply)")
    for row in table["rows"]:
        row["constants"] = harness.format_bytes(row["constants"])
    harness.print_table(table)
    return table


def main(quick: bool = False) -> None:
    size = dict(scenario.SIZES["report"], batch=4 if quick else 16)
    if quick:
        size.update(dim=128, depth=2, mlp=512)
    n_params, cases = _steps(size)
    variants = [harness.Variant(name, fn, args, _program(fn, args)) for name, fn, args in cases]
    title = (
        f"SGD step of a Flax ViT and of its linearization: {n_params / 1e6:.2f}M parameters "
        f"({n_params * 4 / 2**20:.1f} MiB), depth {size['depth']}, width {size['dim']}, "
        f"batch {size['batch']}"
    )
    table = harness.run_table(title, variants, baseline="train f (model.apply)", quick=quick)
    harness.print_table(table)
    tables = [table] if quick else [table, original_table()]
    harness.save("linearize", tables, notes=__doc__.split("\n\n")[0], quick=quick)


if __name__ == "__main__":
    harness.cli(main)
