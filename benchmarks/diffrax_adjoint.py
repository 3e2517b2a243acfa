"""Benchmark ``memwise.diffrax.CheckpointAdjoint`` against Diffrax's ``RecursiveCheckpointAdjoint``.

The adaptive Dormand-Prince solve of ``while_loop.py`` (Lotka-Volterra with a periodic
forcing, ``diffrax.Dopri5`` with a ``PIDController``), now through ``diffeqsolve`` itself
with the solution saved at 50 times (``SaveAt(ts=...)``, the buffers of the loop), so
both adjoints run Diffrax's own step loop and differ only in the while loop under it:
Equinox's checkpointed loop or ``memwise.while_loop``. The gradient of the saved
solution's sum with respect to the ODE's parameters and initial state, float64, at equal
checkpoints. Evaluations count the vector field's calls in the gradient (the solve's own
stages included), with ``jax.debug.callback``, in a separately compiled program.
"""

from __future__ import annotations

import os

import harness
import jax
import jax.numpy as jnp
from while_loop import vector_field

CHECKPOINTS = 16
MAX_STEPS = 16**4
N_SAVES = 50
REPEATS = 7


def _gradient(adjoint, t1, tol, counter=None):
    import diffrax

    def field(t, y, theta):
        if counter is not None:
            jax.debug.callback(counter)
        return vector_field(t, y, theta)

    def loss(theta, y0):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(field),
            diffrax.Dopri5(),
            0.0,
            t1,
            0.01,
            y0,
            args=theta,
            saveat=diffrax.SaveAt(ts=jnp.linspace(0.0, t1, N_SAVES)),
            stepsize_controller=diffrax.PIDController(rtol=tol, atol=tol),
            adjoint=adjoint,
            max_steps=MAX_STEPS,
        )
        return jnp.sum(sol.ys), sol.stats["num_steps"]

    return jax.grad(loss, (0, 1), has_aux=True)


def _count(fn, args):
    """(vector-field calls, output) of one run of the gradient ``fn(counter)``."""
    calls = []
    out = jax.block_until_ready(jax.jit(fn(lambda *_: calls.append(1)))(*args))
    return len(calls), out


def _table(t1, tol, quick):
    import diffrax

    import memwise.diffrax

    theta = jnp.array([1.1, 0.4, 0.4, 0.1])
    y0 = jnp.array([10.0, 5.0])
    args = (theta, y0)
    c = CHECKPOINTS
    adjoints = {
        f"diffrax RecursiveCheckpointAdjoint(checkpoints={c})": diffrax.RecursiveCheckpointAdjoint(
            checkpoints=c
        ),
        f"memwise.diffrax.CheckpointAdjoint(checkpoints={c})": memwise.diffrax.CheckpointAdjoint(
            checkpoints=c
        ),
    }
    variants, gradients = [], []
    for name, adjoint in adjoints.items():
        evaluations, (grads, steps) = _count(
            lambda k, adjoint=adjoint: _gradient(adjoint, t1, tol, k), args
        )
        gradients.append(grads)
        variants.append(
            harness.Variant(
                name,
                _gradient(adjoint, t1, tol),
                args,
                extra={"steps": int(steps), "evaluations": evaluations},
            )
        )
    difference = max(
        float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
        for a, b in zip(jax.tree.leaves(gradients[1]), jax.tree.leaves(gradients[0]))
    )
    for variant in variants:
        variant.extra["gradient rel. diff."] = f"{difference:.1e}"
    steps = variants[0].extra["steps"]
    title = (
        f"diffeqsolve gradient, Dopri5 + PIDController, t1={t1:g}, tol={tol:g}: {steps:,} "
        f"steps, {N_SAVES} saved times, c={c}, max_steps={MAX_STEPS:,}"
    )
    return harness.run_table(
        title, variants, baseline=variants[0].name, repeats=REPEATS, quick=quick
    )


def main(quick: bool = False) -> None:
    load_before = os.getloadavg()[0]
    cases = ((20.0, 1e-5),) if quick else ((150.0, 1e-8),)  # about 1,100 steps
    tables = []
    with jax.enable_x64(True):
        for t1, tol in cases:
            table = _table(t1, tol, quick)
            harness.print_table(table)
            tables.append(table)
    notes = harness.timing_notes(__doc__, load_before, 1 if quick else REPEATS)
    harness.save("diffrax_adjoint", tables, notes=notes, quick=quick)


if __name__ == "__main__":
    harness.cli(main)
