"""Benchmark ``while_loop``: gradients through loops whose length nobody knows in advance.

An adaptive Dormand-Prince (5)4 ODE solve with a step-size controller, written once and
run through ``memwise.while_loop`` and Equinox's ``equinox.internal.while_loop(
kind="checkpointed")`` (what Diffrax's ``RecursiveCheckpointAdjoint`` runs on), with
``diffrax.diffeqsolve`` on the same ODE as the users' reference point; the gradient of the
final state's sum with respect to the ODE's parameters, float64. Trip counts from about
100 to 10,000 steps come from tightening the tolerance and lengthening the interval (an
order-5 method needs 5 decades of tolerance per decade of steps). Then a synthetic body
whose evaluations are counted with ``jax.debug.callback`` at c = 8, 16, 64, next to the
offline optimum ``memwise.schedule.evaluations(t, c)``; and the online schedule's worst
ratio to that optimum over every trip count up to 10,000 (pure Python, the same decisions
the executor takes; the tests check that they agree step by step and count by count).
Last, the one revolve backward both loops run, fed by each one's forward pass (``scan``
stores revolve's optimal positions, ``while_loop`` places its carries online): the same
body through both at t = 10,000, their forward and backward rules timed apart.
"""

from __future__ import annotations

import math
import os

import harness
import jax
import jax.numpy as jnp
import numpy as np

from memwise import schedule
from memwise.scan import scan as memwise_scan
from memwise.scan import while_loop as memwise_while_loop

# Dormand-Prince 5(4) tableau
_C = (0.0, 1 / 5, 3 / 10, 4 / 5, 8 / 9, 1.0, 1.0)
_A = (
    (),
    (1 / 5,),
    (3 / 40, 9 / 40),
    (44 / 45, -56 / 15, 32 / 9),
    (19372 / 6561, -25360 / 2187, 64448 / 6561, -212 / 729),
    (9017 / 3168, -355 / 33, 46732 / 5247, 49 / 176, -5103 / 18656),
    (35 / 384, 0.0, 500 / 1113, 125 / 192, -2187 / 6784, 11 / 84),
)
_B = (35 / 384, 0.0, 500 / 1113, 125 / 192, -2187 / 6784, 11 / 84, 0.0)
_E = (71 / 57600, 0.0, -71 / 16695, 71 / 1920, -17253 / 339200, 22 / 525, -1 / 40)

CHECKPOINTS = 16
# Rounds of interleaved timing per table (the harness's minimum is 5): this benchmark runs
# on a shared machine, and its small cases take a millisecond.
REPEATS = 15


def vector_field(t, y, theta):
    """Lotka-Volterra with a periodic forcing: nonlinear, parameters in every term."""
    a, b, c, d = theta[0], theta[1], theta[2], theta[3]
    prey, predator = y[0], y[1]
    return jnp.stack(
        [a * prey - b * prey * predator + 0.1 * jnp.sin(t), -c * predator + d * prey * predator]
    )


def solve(loop, theta, y0, t1, tol, counter=None):
    """Adaptive Dormand-Prince from 0 to t1 through ``loop(cond, body, init)``."""

    def body(state):
        t, y, dt, steps = state
        if counter is not None:
            jax.debug.callback(counter)
        dt = jnp.minimum(dt, t1 - t)
        ks = []
        for i in range(7):
            yi = y + dt * sum(a * k for a, k in zip(_A[i], ks)) if i else y
            ks.append(vector_field(t + _C[i] * dt, yi, theta))
        y_new = y + dt * sum(b * k for b, k in zip(_B, ks))
        error = dt * sum(e * k for e, k in zip(_E, ks))
        scale = tol + tol * jnp.maximum(jnp.abs(y), jnp.abs(y_new))
        norm = jnp.sqrt(jnp.mean((error / scale) ** 2))
        accept = norm <= 1.0
        factor = jnp.clip(0.9 * jnp.where(norm > 0, norm, 1e-10) ** (-0.2), 0.2, 10.0)
        return (jnp.where(accept, t + dt, t), jnp.where(accept, y_new, y), dt * factor, steps + 1)

    init = (jnp.zeros((), y0.dtype), y0, jnp.asarray(0.01, y0.dtype), jnp.int32(0))
    return loop(lambda s: s[0] < t1 * (1 - 1e-12), body, init)


def _memwise(max_steps, c):
    return lambda cond, body, init: memwise_while_loop(
        cond, body, init, max_steps=max_steps, checkpoints=c
    )


def _equinox(max_steps, c):
    import equinox.internal as eqxi

    return lambda cond, body, init: eqxi.while_loop(
        cond, body, init, max_steps=max_steps, kind="checkpointed", checkpoints=c
    )


def _gradient(loop, t1, tol, counter=None):
    def loss(theta, y0):
        return jnp.sum(solve(loop, theta, y0, t1, tol, counter)[1])

    return jax.grad(loss)


def _diffrax_gradient(t1, tol, max_steps, c):
    import diffrax

    def loss(theta, y0):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(lambda t, y, theta: vector_field(t, y, theta)),
            diffrax.Dopri5(),
            0.0,
            t1,
            0.01,
            y0,
            args=theta,
            stepsize_controller=diffrax.PIDController(rtol=tol, atol=tol),
            adjoint=diffrax.RecursiveCheckpointAdjoint(checkpoints=c),
            max_steps=max_steps,
        )
        return jnp.sum(sol.ys[-1])

    return jax.grad(loss)


def _count(fn, args):
    calls = []
    jax.block_until_ready(jax.jit(fn(lambda *_: calls.append(1)))(*args))
    return len(calls)


def _ode_table(t1, tol, quick):
    theta = jnp.array([1.1, 0.4, 0.4, 0.1])
    y0 = jnp.array([10.0, 5.0])
    args = (theta, y0)
    trips = int(jax.jit(lambda: solve(jax.lax.while_loop, theta, y0, t1, tol)[3])())
    c = CHECKPOINTS
    optimum = schedule.evaluations(trips, c)
    variants = []
    bounds = (4096, 16**4, None) if trips <= 4096 else (16**4, None)
    for max_steps in bounds if not quick else (16**4,):
        label = "None" if max_steps is None else f"{max_steps:,}"
        for name, make in (("equinox", _equinox), ("memwise", _memwise)):
            if name == "equinox" and max_steps is None and not quick:
                continue  # same program as any bound for Equinox's online loop
            evaluations = _count(lambda k: _gradient(make(max_steps, c), t1, tol, k), args)
            variants.append(
                harness.Variant(
                    f"{name} c={c}, max_steps={label}",
                    _gradient(make(max_steps, c), t1, tol),
                    args,
                    extra={"trips": trips, "evaluations": evaluations, "offline optimum": optimum},
                )
            )
    try:
        import diffrax  # noqa: F401
    except ImportError:
        pass
    else:
        variants.append(
            harness.Variant(
                f"diffrax RecursiveCheckpointAdjoint(checkpoints={c}), max_steps=16**4",
                _diffrax_gradient(t1, tol, 16**4, c),
                args,
                extra={"trips": "own controller"},
            )
        )
    title = f"adaptive Dormand-Prince gradient, t1={t1:g}, tol={tol:g}: {trips:,} steps, c={c}"
    baseline = next(v.name for v in variants if v.name.startswith("equinox"))
    return harness.run_table(title, variants, baseline=baseline, repeats=REPEATS, quick=quick)


def _synthetic_table(c, lengths, quick):
    hidden = 32
    w = jnp.asarray(np.random.default_rng(0).normal(size=(hidden, hidden)) / hidden**0.5)
    h0 = jnp.ones(hidden)

    def gradient(make, counter=None):
        def loss(w, limit):
            def body(s):
                if counter is not None:
                    jax.debug.callback(counter)
                return jnp.tanh(w @ s[0]), s[1] + 1

            return jnp.sum(make(None, c)(lambda s: s[1] < limit, body, (h0, 0))[0])

        return jax.grad(loss)

    variants = []
    for t in lengths:
        optimum = schedule.evaluations(t, c)
        counts = {
            name: _count(lambda k: gradient(make, k), (w, t))
            for name, make in (("equinox", _equinox), ("memwise", _memwise))
        }
        for name, make in (("equinox", _equinox), ("memwise", _memwise)):
            variants.append(
                harness.Variant(
                    f"{name}, t={t:,}",
                    gradient(make),
                    (w, t),
                    extra={
                        "evaluations": counts[name],
                        "offline optimum": optimum,
                        "/ optimum": round(counts[name] / optimum, 4),
                    },
                )
            )
    table = harness.run_table(
        f"synthetic loop (tanh(W h), hidden {hidden}), c={c}, max_steps=None: counted "
        "evaluations; last column: time / Equinox's at the same t",
        variants,
        baseline=variants[0].name,
        repeats=REPEATS,
        quick=quick,
    )
    rows = {row["variant"]: row for row in table["rows"]}
    for t in lengths:
        equinox = rows[f"equinox, t={t:,}"]["time_s"]
        for name in ("equinox", "memwise"):
            row = rows[f"{name}, t={t:,}"]
            row["time / equinox at t"] = (
                round(row["time_s"] / equinox, 3) if row["time_s"] and equinox else None
            )
    return table


def _executor_table(c, t, quick):
    """The one revolve backward on one body, from scan's stored positions and from
    while_loop's, forward and backward rules timed apart (``jax.vjp`` jitted, then its
    pullback)."""
    hidden = 32
    w = jnp.asarray(np.random.default_rng(0).normal(size=(hidden, hidden)) / hidden**0.5)
    h0 = jnp.ones(hidden)

    def scan_loss(counter=None):
        def loss(w):
            def step(h, _):
                if counter is not None:
                    jax.debug.callback(counter)
                return jnp.tanh(w @ h), None

            return jnp.sum(memwise_scan(step, h0, length=t, checkpoints=c)[0])

        return loss

    def while_loss(counter=None):
        def loss(w):
            def body(s):
                if counter is not None:
                    jax.debug.callback(counter)
                return jnp.tanh(w @ s[0]), s[1] + 1

            return jnp.sum(memwise_while_loop(lambda s: s[1] < t, body, (h0, 0), checkpoints=c)[0])

        return loss

    variants = []
    for name, make in (
        ("scan (revolve's positions)", scan_loss),
        ("while_loop (online positions)", while_loss),
    ):
        evaluations = _count(lambda k, make=make: jax.grad(make(k)), (w,))
        forward = lambda w, make=make: jax.vjp(make(), w)  # noqa: E731
        _, pullback = jax.jit(forward)(w)
        extra = {"evaluations": evaluations}
        variants.append(harness.Variant(f"{name}: forward rule", forward, (w,), extra=extra))
        backward = lambda pullback: pullback(jnp.ones(()))  # noqa: E731
        variants.append(
            harness.Variant(f"{name}: backward rule", backward, (pullback,), extra=extra)
        )
    return harness.run_table(
        f"the revolve backward from scan's and while_loop's stored carries: the same body (tanh(W h), hidden "
        f"{hidden}), t={t:,}, c={c}",
        variants,
        baseline=variants[1].name,
        repeats=REPEATS,
        quick=quick,
    )


def _schedule_table(n_max):
    rows = []
    for c in (4, 8, 16, 64):
        online = schedule.OnlineCheckpointer(c)
        three = math.comb(c + 3, 3)
        worst, worst_t, worst_three, exact_below = 1.0, 1, 1.0, None
        for t in range(1, n_max + 1):
            ratio = online.evaluations(t) / schedule.evaluations(t, c)
            if ratio > worst:
                worst, worst_t = ratio, t
            if t <= three:
                worst_three = max(worst_three, ratio)
            if exact_below is None and ratio > 1:
                exact_below = t
            online.offer(t)
        rows.append(
            {
                "variant": f"online, c={c}",
                "temp_bytes": 0,
                "peak_bytes": 0,
                "argument_bytes": 0,
                "output_bytes": 0,
                "compile_s": 0.0,
                "time_s": None,
                "time_ratio": None,
                "worst / optimum": round(worst, 4),
                "at t": worst_t,
                "worst for t <= (c+1)(c+2)(c+3)/6": round(worst_three, 4),
                "optimal for t <": exact_below or n_max + 1,
            }
        )
    return {
        "title": f"online schedule / offline optimum, every t up to {n_max:,} (pure "
        "Python; no memory or time)",
        "baseline": rows[0]["variant"],
        "repeats": 0,
        "rows": rows,
    }


def main(quick: bool = False) -> None:
    load_before = os.getloadavg()[0]
    tables = [_schedule_table(1_000 if quick else 10_000)]
    harness.print_table(tables[0])
    cases = (
        ((20.0, 1e-5), (200.0, 1e-7))
        if quick
        else ((50.0, 1e-5), (150.0, 1e-8), (300.0, 1e-9), (600.0, 1e-10))
    )
    with jax.enable_x64(True):
        for t1, tol in cases:
            table = _ode_table(t1, tol, quick)
            harness.print_table(table)
            tables.append(table)
    lengths = (100, 1000) if quick else (100, 500, 2_000, 10_000)
    for c in (8,) if quick else (8, 16, 64):
        table = _synthetic_table(c, lengths, quick)
        harness.print_table(table)
        tables.append(table)
    for c in (8,) if quick else (8, 16, 64):
        table = _executor_table(c, 1_000 if quick else 10_000, quick)
        harness.print_table(table)
        tables.append(table)
    notes = harness.timing_notes(__doc__, load_before, 1 if quick else REPEATS)
    harness.save("while_loop", tables, notes=notes, quick=quick)


if __name__ == "__main__":
    harness.cli(main)
