"""Gromov-Wasserstein and low-rank Sinkhorn on one TPU chip: ``tpu.py --suite ot``.

Gromov-Wasserstein's linear solves are log-sum-exps of inner products of augmented
points, the pattern of the fused Sinkhorn kernel (``implementation="pallas"``, the
default on a TPU); low-rank Sinkhorn of the squared Euclidean cost is matrix products of
``(n, rank)`` factors and runs as XLA. Each variant does a fixed amount of work (a set
number of outer and inner iterations), so times compare across variants.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp

import memwise as mw
from benchmarks.tpu import dense_potentials

OUTER, INNER = 5, 100


def _sqdist(x, y):
    return jnp.sum(x * x, 1)[:, None] + jnp.sum(y * y, 1)[None] - 2 * x @ y.T


def _dense_gw(x, y, eps):
    """Entropic GW with the n x n, m x m and n x m matrices held: the same iterations as
    ``mw.ot.gromov_wasserstein`` (first linearisation at a b^T, then ``OUTER`` more,
    ``INNER`` log-domain Sinkhorn iterations each), the plan held for the gradient."""
    n, m = x.shape[0], y.shape[0]
    log_a, log_b = jnp.full(n, -jnp.log(n)), jnp.full(m, -jnp.log(m))

    def linearised(x, y, plan):
        cx, cy = _sqdist(x, x), _sqdist(y, y)
        p, q = jnp.sum(plan, 1), jnp.sum(plan, 0)
        return (cx**2 @ p)[:, None] + (cy**2 @ q)[None] - 2 * cx @ plan @ cy

    def solve(c):
        f, g = dense_potentials(c, log_a, log_b, eps, INNER)
        return jnp.exp(log_a[:, None] + log_b[None] + (f[:, None] + g[None] - c) / eps)

    sx, sy = jax.lax.stop_gradient((x, y))
    plan = jnp.exp(log_a[:, None] + log_b[None])
    plan = jax.lax.fori_loop(0, OUTER + 1, lambda _, p: solve(linearised(sx, sy, p)), plan)
    plan = jax.lax.stop_gradient(plan)
    return jnp.sum(plan * linearised(x, y, plan))


def _memwise_gw(x, y, eps, implementation):
    out = mw.ot.gromov_wasserstein(
        x,
        y,
        epsilon=eps,
        min_iterations=OUTER,
        max_iterations=OUTER,
        sinkhorn_options=dict(
            min_iterations=INNER, max_iterations=INNER, implementation=implementation
        ),
    )
    return out.reg_gw_cost


def run_gromov(n, d, measure, *, repeats, only=(), dense=True, xla=True):
    kx, ky = jax.random.split(jax.random.key(3))
    x = jax.random.normal(kx, (n, d), jnp.float32) / d**0.5
    y = jax.random.normal(ky, (n, d), jnp.float32) / d**0.5 * 1.2
    eps = 1.0
    variants = {}
    if dense:
        variants["dense"] = lambda x, y: _dense_gw(x, y, eps)
    if xla:
        variants["memwise xla"] = lambda x, y: _memwise_gw(x, y, eps, "xla")
    variants["memwise pallas"] = lambda x, y: _memwise_gw(x, y, eps, "pallas")

    def highest(x, y):
        with jax.default_matmul_precision("highest"):
            return _memwise_gw(x, y, eps, "pallas")

    variants["memwise pallas, highest precision"] = highest
    rows = []
    for name, fn in variants.items():
        if only and not name.startswith(tuple(only)):
            continue
        f = jax.value_and_grad(fn, (0, 1))
        r = measure(f, (x, y), 0.0, repeats if name == "memwise pallas" else 1)
        r.pop("tflops", None)
        row = {"variant": name, **r}
        if "ms" in r:
            # Sinkhorn passes: two per inner iteration, OUTER + 1 solves
            row["gpairs_s"] = 2 * INNER * (OUTER + 1) * n * n / (r["ms"] * 1e-3) / 1e9
            if name != "dense":  # its <L(P), P>, not the regularised cost
                row["value"] = float(jax.jit(fn)(x, y))
        rows.append(row)
        print(json.dumps({"n": n, "d": d, **row}), flush=True)
    return rows


def run_low_rank(n, d, rank, measure, *, repeats, only=(), steps=100):
    kx, ky = jax.random.split(jax.random.key(4))
    x = jax.random.normal(kx, (n, d), jnp.float32) / d**0.5
    y = jax.random.normal(ky, (n, d), jnp.float32) / d**0.5 + 0.1

    def low_rank(x, y):
        out = mw.ot.low_rank_sinkhorn(
            x, y, rank=rank, min_iterations=steps, max_iterations=steps, threshold=1e-12
        )
        return out.reg_ot_cost

    def sinkhorn(x, y):
        out = mw.ot.sinkhorn(x, y, epsilon=0.1, min_iterations=steps, max_iterations=steps)
        return out.reg_ot_cost

    variants = {f"mw.ot.low_rank_sinkhorn, rank {rank}": low_rank}
    if n <= 100_000:
        variants["mw.ot.sinkhorn, epsilon 0.1 (kernel)"] = sinkhorn
    rows = []
    for name, fn in variants.items():
        if only and not name.startswith(tuple(only)):
            continue
        r = measure(jax.value_and_grad(fn, (0, 1)), (x, y), 0.0, repeats)
        r.pop("tflops", None)
        row = {"variant": name, **r}
        if "ms" in r:
            row["value"] = float(jax.jit(fn)(x, y))
        rows.append(row)
        print(json.dumps({"n": n, "d": d, **row}), flush=True)
    return rows


NOTES = (
    "One TPU v5e chip, float32 points N(0, 1/d) (y scaled by 1.2 for Gromov-Wasserstein, "
    "shifted by 0.1 for the linear problems), value_and_grad of the cost in both clouds. "
    f"Gromov-Wasserstein: epsilon 1, the first linearisation and {OUTER} more, each solved "
    f"by exactly {INNER} Sinkhorn iterations (two passes over the n x n pairs each); "
    "dense: the same iterations in plain JAX on held n x n matrices; memwise xla: the "
    "XLA tiles; memwise pallas: the fused Sinkhorn kernel (the default on a TPU). Pairs "
    "per second count the Sinkhorn passes only (each outer iteration also applies the "
    "plan to d + 2 vectors and sums |x_i - x_k|^4 over pairs). Low rank: exactly 100 "
    "mirror-descent steps of mw.ot.low_rank_sinkhorn (squared Euclidean cost through "
    "its rank-(d + 2) factors), beside 100 iterations of mw.ot.sinkhorn on the same "
    "points. value: the regularised cost memwise returns (reg_gw_cost, reg_ot_cost). Default matmul precision unless stated. "
    "The 10,000-point Gromov-Wasserstein rows were re-measured after the sums of "
    "|x_i - x_k|^4 moved to the pair function's kernel forward (memwise pallas 342.6 ms "
    "and 23.9 MiB before); the 50,000-point rows predate it."
)


def tables(cases: dict) -> list[dict]:
    out = []
    for case, rows in cases.items():
        gw = case.startswith("Gromov")
        base = next((r for r in rows if r["variant"] == "dense" and "ms" in r), None)
        columns = [["variant", "variant"], ["ms", "value_and_grad ms"]]
        columns += [["x", "/ dense"], ["gp", "G pairs/s"]] if gw else []
        columns += [["value", "value"], ["temp", "temp"]]
        table_rows = []
        for r in rows:
            if "ms" not in r:
                table_rows.append({"variant": r["variant"], "ms": r["error"][:60]})
                continue
            row = {
                "variant": r["variant"],
                "ms": f"{r['ms']:.1f}",
                "value": f"{r['value']:.6g}" if "value" in r else "-",
                "temp": f"{r['temp_mib']:.1f} MiB",
            }
            if gw:
                row["x"] = "-" if base is None else f"{r['ms'] / base['ms']:.2f}x"
                row["gp"] = f"{r['gpairs_s']:.0f}"
            table_rows.append(row)
        out.append({"title": f"{case} on one TPU v5e", "columns": columns, "rows": table_rows})
    return out


def cases(measure, *, cpu: bool, repeats: int) -> list:
    """``(case name, run(only))`` pairs of the suite."""
    if cpu:
        return [
            (
                "Gromov-Wasserstein, 256 points a side, d = 3",
                lambda only: run_gromov(256, 3, measure, repeats=1, only=only),
            ),
            (
                "low-rank, 256 points a side, d = 3",
                lambda only: run_low_rank(256, 3, 4, measure, repeats=1, only=only),
            ),
        ]
    return [
        (
            "Gromov-Wasserstein, 10,000 points a side, d = 3",
            lambda only: run_gromov(10_000, 3, measure, repeats=repeats, only=only),
        ),
        (
            "Gromov-Wasserstein, 50,000 points a side, d = 3",
            lambda only: run_gromov(
                50_000, 3, measure, repeats=1, only=only, dense=False, xla=False
            ),
        ),
        (
            "Gromov-Wasserstein, 50,000 points a side, d = 32",
            lambda only: run_gromov(
                50_000, 32, measure, repeats=1, only=only, dense=False, xla=False
            ),
        ),
        (
            "low-rank, 100,000 points a side, d = 32",
            lambda only: run_low_rank(100_000, 32, 10, measure, repeats=repeats, only=only),
        ),
        (
            "low-rank, 1,000,000 points a side, d = 3",
            lambda only: run_low_rank(1_000_000, 3, 10, measure, repeats=3, only=only),
        ),
    ]
