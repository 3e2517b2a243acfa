"""Benchmark ``low_rank``: low-rank Sinkhorn with gradients, memwise's
``low_rank_sinkhorn`` against OTT-JAX's ``LRSinkhorn`` (rank 10, their defaults, the
same initial factors).

Part 1: ``value_and_grad`` of the cost in both clouds (d = 3), compiled temporaries and
time, for the squared Euclidean cost at n = m = 2,000 and 10,000 points (both libraries
apply it through its rank d + 2) and the Euclidean cost at 2,000 (OTT's point cloud
forms the n x m cost matrix; memwise recomputes it in chunked passes at every step, or
forms it once and holds it with ``chunk_size=None``). Part 2, compiled
only: both at 50,000 points, where OTT's Euclidean cost matrix alone is 10 GB. OTT's
``batch_size=`` online mode is left out: on JAX 0.10.2 it fails with an
``AttributeError`` (``jax.interpreters.batching.is_vmappable``).

Times are medians of interleaved runs on a shared machine: read the ratios.
"""

from __future__ import annotations

import harness
import jax
import jax.numpy as jnp
from harness import Variant, run_table, save
from ott.geometry import costs, pointcloud
from ott.problems.linear import linear_problem
from ott.solvers.linear import sinkhorn_lr

from memwise import ot
from memwise.measure import compiled_memory

RANK = 10
OTT_COSTS = {"sqeuclidean": costs.SqEuclidean(), "euclidean": costs.Euclidean()}


def _clouds(n, d=3, seed=0):
    k = jax.random.split(jax.random.key(seed), 2)
    return jax.random.normal(k[0], (n, d)), jax.random.normal(k[1], (n, d)) + 0.5


def _memwise(cost, chunk_size="auto"):
    def value(x, y):
        return ot.low_rank_sinkhorn(x, y, rank=RANK, cost=cost, chunk_size=chunk_size).reg_ot_cost

    return value


def _ott(cost):
    def value(x, y):
        geom = pointcloud.PointCloud(x, y, cost_fn=OTT_COSTS[cost])
        return sinkhorn_lr.LRSinkhorn(RANK)(linear_problem.LinearProblem(geom)).reg_ot_cost

    return value


def main(quick: bool = False) -> None:
    tables = []
    sizes = {"sqeuclidean": (2000, 10_000), "euclidean": (2000,)}
    for cost in OTT_COSTS:
        for n in (500,) if quick else sizes[cost]:
            x, y = _clouds(n)
            variants = [
                Variant("OTT-JAX LRSinkhorn", jax.value_and_grad(_ott(cost), (0, 1)), (x, y)),
                Variant(
                    "memwise low_rank_sinkhorn", jax.value_and_grad(_memwise(cost), (0, 1)), (x, y)
                ),
            ]
            if cost != "sqeuclidean":
                held = jax.value_and_grad(_memwise(cost, None), (0, 1))
                variants.append(Variant("memwise, chunk_size=None", held, (x, y)))
            table = run_table(
                f"{cost}, n = m = {n:,}, rank {RANK}",
                variants,
                baseline="OTT-JAX LRSinkhorn",
                repeats=3,
                quick=quick,
            )
            tables.append(table)
            harness.print_table(table)
    rows = []
    shape = jax.ShapeDtypeStruct((50_000, 3), jnp.float32)
    for cost in OTT_COSTS:
        for name, fn in (("OTT-JAX", _ott(cost)), ("memwise", _memwise(cost))):
            memory = compiled_memory(jax.value_and_grad(fn, (0, 1)), shape, shape)
            rows.append({"variant": f"{name}, {cost}", "temp_bytes": memory.temp_bytes})
    table = {
        "title": f"value_and_grad at n = m = 50,000, d = 3, rank {RANK}, compiled only (float32)",
        "columns": [["variant", "variant"], ["temp_bytes", "temp"]],
        "rows": rows,
    }
    tables.append(table)
    harness.print_table(table)
    save("low_rank", tables, notes=__doc__.split("\n\n", 1)[1].strip(), quick=quick)


if __name__ == "__main__":
    harness.cli(main)
