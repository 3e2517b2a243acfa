"""Benchmark ``reversible``: the gradient of a reversible residual network over n steps.

A RevNet (additive coupling, Gomez et al. 2017: y1 = x1 + h F(x2, t), y2 = x2 + h G(y1),
with F and G one-layer tanh residuals of width 32, weights shared by the steps, batch 2;
h = 5 / n, the network as the discretisation of an ODE over [0, 5], Chang et al. 2018)
run for n = 1,000, 10,000 and 100,000 steps; the gradient of a loss of the final state with
respect to the weights. Variants: ``mw.scan(..., inverse=)`` (the carries rebuilt by the
inverse: one kept), the same keeping 16 carries (the drift bounded to n/16 steps), the
checkpointed ``mw.scan`` (binomial schedule, default checkpoints), ``lax.scan`` of
``jax.checkpoint(step)`` and plain ``lax.scan``. Columns: XLA temp memory of the
gradient (and its ratio to the same variant at 1,000 steps), the wall time against the
reference's at the same length, the gradient's largest
relative error against ``lax.scan``'s in the same dtype (at 100,000 steps against the
binomial ``mw.scan``, whose carries are stored, not rebuilt: ``lax.scan`` keeps 100,000
steps of residuals there and is compiled, not run), its error against the float64
gradient (float32 tables), and the largest relative drift the ``DriftLog`` recorded.
"""

from __future__ import annotations

import os

import harness
import jax
import jax.numpy as jnp

import memwise as mw

WIDTH = 32
BATCH = 2
HORIZON = 5.0  # the residual branches' weight is HORIZON / n: more steps, finer steps
LENGTHS = (1_000, 10_000, 100_000)
KEPT = 16


def revnet(params, n):
    """``(step, inverse)`` of the coupling over n steps; xs are the steps' times in [0, 1)."""
    w_f, w_g, b_f = params
    h = HORIZON / n

    def residual_f(x2, t):
        return h * jnp.tanh(x2 @ w_f + jnp.sin(6.0 * t) * b_f)

    def residual_g(y1):
        return h * jnp.tanh(y1 @ w_g)

    def step(carry, t):
        x1, x2 = carry
        y1 = x1 + residual_f(x2, t)
        return (y1, x2 + residual_g(y1)), None

    def inverse(carry, t):
        y1, y2 = carry
        x2 = y2 - residual_g(y1)
        return (y1 - residual_f(x2, t), x2)

    return step, inverse


def _loss(kind, log=None):
    def loss(params, init, ts):
        step, inverse = revnet(params, ts.shape[0])
        if kind == "inverse":
            carry, _ = mw.scan(step, init, ts, inverse=inverse, drift=log)
        elif kind == "inverse, kept":
            carry, _ = mw.scan(step, init, ts, inverse=inverse, checkpoints=KEPT, drift=log)
        elif kind == "binomial":
            carry, _ = mw.scan(step, init, ts)
        elif kind == "per_step":
            carry, _ = jax.lax.scan(jax.checkpoint(step), init, ts)
        else:
            carry, _ = jax.lax.scan(step, init, ts)
        return jnp.sum(carry[0] * carry[1]) / BATCH

    return jax.grad(loss)


def _inputs(n, dtype):
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    normal = lambda k, shape: jax.random.normal(k, shape, jnp.float64).astype(dtype)  # noqa: E731
    params = (
        normal(keys[0], (WIDTH, WIDTH)) / WIDTH**0.5,
        normal(keys[1], (WIDTH, WIDTH)) / WIDTH**0.5,
        normal(keys[2], (WIDTH,)),
    )
    init = (normal(keys[3], (BATCH, WIDTH)), normal(keys[4], (BATCH, WIDTH)))
    return params, init, (jnp.arange(n, dtype=jnp.float64) / n).astype(dtype)


def _error(grads, reference):
    worst = 0.0
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(reference)):
        r = jnp.asarray(r, jnp.float64)
        worst = max(worst, float(jnp.max(jnp.abs(g - r)) / jnp.max(jnp.abs(r))))
    return worst


KINDS = (
    ("inverse", "mw.scan(inverse=)"),
    ("inverse, kept", f"mw.scan(inverse=, checkpoints={KEPT})"),
    ("binomial", "mw.scan (binomial, default checkpoints)"),
    ("per_step", "lax.scan(jax.checkpoint(step))"),
    ("lax", "lax.scan"),
)


def _table(dtype, lengths, quick, temps_at_first):
    variants = []
    for n in lengths:
        args = _inputs(n, dtype)
        run_reference = n <= 10_000
        reference_kind = "lax" if run_reference else "binomial"
        reference = jax.jit(_loss(reference_kind))(*args)
        truth = None
        if dtype != jnp.float64:
            with jax.enable_x64(True):
                truth = jax.jit(_loss(reference_kind))(*_inputs(n, jnp.float64))
        for kind, label in KINDS:
            big = n > 10_000 and kind in ("per_step", "lax")
            # At 100,000 steps only the float64 reversible and reference gradients are
            # timed (a run takes seconds on a shared machine); the rest are compiled.
            timed = not big and (n <= 10_000 or (dtype == jnp.float64 and kind != "inverse, kept"))
            extra: dict = {"n": n}
            # the reversible variants against the reference (the others store their
            # carries: they agree with it to rounding, as the tests check)
            if kind.startswith("inverse") or kind == reference_kind:
                log = mw.DriftLog()
                grads = jax.jit(_loss(kind, log))(*args) if kind != reference_kind else reference
                extra["error vs " + ("lax.scan" if run_reference else "binomial")] = _error(
                    grads, reference
                )
                if truth is not None:
                    extra["error vs float64"] = _error(grads, truth)
                extra["max drift"] = log.max_relative if kind.startswith("inverse") else None
            variants.append(
                harness.Variant(f"{label}, n={n:,}", _loss(kind), args, extra=extra, run=timed)
            )
    name = jnp.dtype(dtype).name
    table = harness.run_table(
        f"RevNet gradient, width {WIDTH}, batch {BATCH}, {name}; at 100,000 steps lax.scan "
        "compiled, not run" + ("" if dtype == jnp.float64 else ", nothing timed"),
        variants,
        baseline=f"lax.scan, n={lengths[0]:,}",
        repeats=5,
        quick=quick,
    )
    times = {(r["n"], r["variant"].rsplit(", n=", 1)[0]): r["time_s"] for r in table["rows"]}
    for row in table["rows"]:
        label = row["variant"].rsplit(", n=", 1)[0]
        base = times.get((row["n"], "lax.scan")) or times.get((row["n"], KINDS[2][1]))
        row["time / reference at n"] = (
            round(row["time_s"] / base, 3) if row["time_s"] and base else None
        )
        if row["n"] == lengths[0]:
            temps_at_first[(name, label)] = row["temp_bytes"]
        first = temps_at_first[(name, label)]
        row["temp / at n=1,000"] = round(row["temp_bytes"] / first, 4) if first else None
    return table


def main(quick: bool = False) -> None:
    load_before = os.getloadavg()[0]
    lengths = LENGTHS[:2] if quick else LENGTHS
    tables = []
    temps: dict = {}
    with jax.enable_x64(True):
        for dtype in (jnp.float64, jnp.float32):
            table = _table(dtype, lengths, quick, temps)
            harness.print_table(table)
            tables.append(table)
    notes = harness.timing_notes(__doc__, load_before, 1 if quick else 5)
    harness.save("reversible", tables, notes=notes, quick=quick)


if __name__ == "__main__":
    harness.cli(main)
