"""Benchmark ``gromov``: entropic Gromov-Wasserstein with gradients, memwise against
OTT-JAX's ``GromovWasserstein`` (dense: it converts squared Euclidean point clouds to
low-rank geometries but forms every linearised ``n x m`` cost).

Part 1, at n = m = 1,000 and 2,000 points (d = 3 and d' = 2, epsilon 1, OTT's defaults):
the gradient of ``reg_gw_cost`` in both clouds, compiled temporaries and time for
memwise and OTT-JAX. Part 2, compiled only: memwise at 50,000 points (d = 3 and d = 32)
and OTT-JAX at 4,000 points, whose temporaries (about 4 n^2 floats) say where it stops
fitting.

Times are medians of interleaved runs on a shared machine: read the ratios.
"""

from __future__ import annotations

import harness
import jax
import jax.numpy as jnp
from harness import Variant, run_table, save
from ott.geometry import pointcloud
from ott.problems.quadratic import quadratic_problem
from ott.solvers.linear import sinkhorn as ott_sinkhorn
from ott.solvers.quadratic import gromov_wasserstein as ott_gw

from memwise import ot
from memwise.measure import compiled_memory

EPSILON = 1.0


def _clouds(n, d, d2, seed=0):
    k = jax.random.split(jax.random.key(seed), 2)
    x = jax.random.normal(k[0], (n, d))
    y = 1.3 * jax.random.normal(k[1], (n, d2))
    return x, y


def _memwise(x, y):
    return ot.gromov_wasserstein(x, y, epsilon=EPSILON).reg_gw_cost


def _ott(x, y):
    problem = quadratic_problem.QuadraticProblem(pointcloud.PointCloud(x), pointcloud.PointCloud(y))
    solver = ott_gw.GromovWasserstein(ott_sinkhorn.Sinkhorn(), epsilon=EPSILON)
    return solver(problem).reg_gw_cost


def main(quick: bool = False) -> None:
    tables = []
    for n in (500,) if quick else (1000, 2000):
        x, y = _clouds(n, 3, 2)
        variants = [
            Variant("OTT-JAX GromovWasserstein", jax.value_and_grad(_ott, (0, 1)), (x, y)),
            Variant("memwise gromov_wasserstein", jax.value_and_grad(_memwise, (0, 1)), (x, y)),
        ]
        table = run_table(
            f"GW gradient, n = m = {n:,}, d = 3 / 2",
            variants,
            baseline="OTT-JAX GromovWasserstein",
            repeats=3,
            quick=quick,
        )
        tables.append(table)
        harness.print_table(table)
    rows = []
    for n, d in ((50_000, 3), (50_000, 32)):
        shape = jax.ShapeDtypeStruct((n, d), jnp.float32)
        memory = compiled_memory(jax.grad(_memwise, (0, 1)), shape, shape)
        rows.append({"variant": f"memwise, n = {n:,}, d = {d}", "temp_bytes": memory.temp_bytes})
    for n in (2000, 4000):
        shape = jax.ShapeDtypeStruct((n, 3), jnp.float32)
        memory = compiled_memory(jax.grad(_ott, (0, 1)), shape, shape)
        per_pair = memory.temp_bytes / n**2
        fits = int((24e9 / per_pair) ** 0.5)
        rows.append(
            {
                "variant": f"OTT-JAX, n = {n:,}, d = 3",
                "temp_bytes": memory.temp_bytes,
                "bytes per pair": round(per_pair, 2),
                "largest n in 24 GB": fits,
            }
        )
    table = {
        "title": "GW gradient, compiled only (float32)",
        "columns": [
            ["variant", "variant"],
            ["temp_bytes", "temp"],
            ["bytes per pair", "OTT bytes per pair"],
            ["largest n in 24 GB", "OTT's largest n in 24 GB"],
        ],
        "rows": rows,
    }
    tables.append(table)
    harness.print_table(table)
    save("gromov", tables, notes=__doc__.split("\n\n", 1)[1].strip(), quick=quick)


if __name__ == "__main__":
    harness.cli(main)
