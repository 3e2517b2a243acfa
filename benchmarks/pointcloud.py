"""Benchmark ``pointcloud``: Sinkhorn divergence of point clouds with gradients, memwise vs
OTT-JAX, on the problem of OTT-JAX issue 417.

Part 1 runs the report's exact program (n = 50,000 points in discs of radius 5 and 10,
default epsilon, gradient in x) with ``mw.ot.sinkhorn_divergence`` and reports the
process's peak RSS, the compiled temp memory, iterations, wall time and the value.

Part 2 compares, at n = m = 20,000 (discs of radius 1 and 2, epsilon 0.1, threshold 1e-3),
the gradient of one Sinkhorn solve's
``reg_ot_cost``: memwise with and without epsilon scaling, OTT-JAX dense on the current
jax, plain dense JAX (compile only: they hold the 20,000 x 20,000 matrix several times),
and OTT-JAX online (``batch_size=1000``), which no longer runs on current jax and is run
in a separate venv pinned to ``jax==0.7.2 ott-jax==0.6.0`` that this script creates
(``benchmarks/.venv-ott``, git-ignored). Its gradient memory is the anchor.

Times are single solves measured in this run (the machine is shared: read the ratios).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import harness
import jax
import jax.numpy as jnp
import numpy as np
from harness import Variant, peak_rss_bytes, run_table, save

from memwise import ot
from memwise.measure import CompiledMemory, compiled_memory
from memwise.scenarios import pointcloud

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
OTT_VENV = HERE / ".venv-ott"
OTT_PINS = ("jax==0.7.2", "jaxlib==0.7.2", "ott-jax==0.6.0")
MIB = 2**20

# Runs under jax 0.7.2, below memwise's floor: it imports no memwise. The clouds come
# from this process (an .npz file) and the compiled programs' memory_analysis() fields
# go back raw, read by memwise's CompiledMemory here.
_OTT_ONLINE = r"""
import json, sys, time
import jax, numpy as np
from ott.geometry import pointcloud
from ott.problems.linear import linear_problem
from ott.solvers.linear import sinkhorn

path, eps, threshold, run = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4] == "1"
with np.load(path) as clouds:
    x, y = jax.numpy.asarray(clouds["x"]), jax.numpy.asarray(clouds["y"])

def solve(x, y):
    geom = pointcloud.PointCloud(x, y, epsilon=eps, batch_size=1000)
    out = sinkhorn.Sinkhorn(threshold=threshold, use_danskin=True)(linear_problem.LinearProblem(geom))
    return out.reg_ot_cost, (out.n_iters, out.converged)

def stats(fn):
    m = jax.jit(fn).lower(x, y).compile().memory_analysis()
    names = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
             "temp_size_in_bytes", "peak_memory_in_bytes", "generated_code_size_in_bytes")
    return {k: int(getattr(m, k, 0) or 0) for k in names}

loss = lambda x, y: solve(x, y)[0]
result = {"jax": jax.__version__, "forward": stats(loss)}
start = time.perf_counter()
result["grad"] = stats(jax.grad(loss))
result["compile_s"] = time.perf_counter() - start
if run:
    f = jax.jit(solve)
    jax.block_until_ready(f(x[:8], y[:8]))
    start = time.perf_counter()
    cost, (iters, converged) = jax.block_until_ready(f(x, y))
    result.update(solve_s=time.perf_counter() - start, iterations=int(iters),
                  converged=bool(converged), reg_ot_cost=float(cost))
print("RESULT" + json.dumps(result))
"""


def ensure_ott_venv() -> Path:
    """Creates ``benchmarks/.venv-ott`` (jax 0.7.2, ott-jax 0.6.0) when missing."""
    python = OTT_VENV / "bin" / "python"
    check = [str(python), "-c", "import ott, jax; assert jax.__version__ == '0.7.2'"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    subprocess.run([sys.executable, "-m", "venv", str(OTT_VENV)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", *OTT_PINS], check=True)
    return python


def ott_online(x: jax.Array, y: jax.Array, eps: float, threshold: float, run: bool) -> dict:
    """OTT-JAX online on ``(x, y)`` in the pinned venv: its version, the forward's and
    the gradient's :class:`CompiledMemory`, the compile time and (``run``) one solve."""
    python = ensure_ott_venv()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "clouds.npz"
        np.savez(path, x=np.asarray(x), y=np.asarray(y))
        proc = subprocess.run(
            [str(python), "-c", _OTT_ONLINE, str(path), str(eps), str(threshold), str(int(run))],
            capture_output=True,
            text=True,
            env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
        )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    if proc.returncode or not lines:
        raise RuntimeError(f"OTT online run failed:\n{proc.stderr[-3000:]}")
    result = json.loads(lines[-1][len("RESULT") :])
    for kind in ("forward", "grad"):
        result[kind] = CompiledMemory.from_stats(SimpleNamespace(**result[kind]))
    return result


def report_case(n: int) -> dict:
    """The program of OTT-JAX issue 417 with memwise; run first so peak RSS is this case's."""
    x, y = pointcloud.report_clouds(n)

    def loss(x, y):
        value, (xy, xx, yy) = ot.sinkhorn_divergence(x, y, return_results=True)
        return value, (
            xy.n_iterations,
            xx.n_iterations,
            yy.n_iterations,
            xy.epsilon,
            xy.converged & xx.converged & yy.converged,
        )

    start = time.perf_counter()
    memory = compiled_memory(lambda x, y: loss(x, y)[0], x, y, grad=True)
    compile_s = time.perf_counter() - start
    fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
    start = time.perf_counter()
    (value, (it_xy, it_xx, it_yy, eps, converged)), grad = jax.block_until_ready(fn(x, y))
    wall = time.perf_counter() - start
    return {
        "temp_bytes": memory.temp_bytes,
        "peak_bytes": memory.peak_bytes,
        "time_ratio": None,
        "compile_s": compile_s,
        "n": n,
        "divergence": float(value),
        "epsilon": float(eps),
        "iterations_xy_xx_yy": [int(it_xy), int(it_xx), int(it_yy)],
        "converged": bool(converged),
        "grad_finite": bool(jnp.all(jnp.isfinite(grad))),
        "wall_s_incl_compile": wall,
        "peak_rss_MiB": peak_rss_bytes() / MIB,
    }


def _ott_dense_cost(x, y, eps, threshold):
    from ott.geometry import pointcloud as ott_pointcloud
    from ott.problems.linear import linear_problem
    from ott.solvers.linear import sinkhorn

    geom = ott_pointcloud.PointCloud(x, y, epsilon=eps)
    solver = sinkhorn.Sinkhorn(threshold=threshold, use_danskin=True)
    return solver(linear_problem.LinearProblem(geom)).reg_ot_cost


def _dense_jax_cost(x, y, eps, threshold):
    return pointcloud._dense_reg_ot(x, y, eps, threshold)


def comparison(n: int, eps: float, threshold: float, run_ott_online: bool) -> dict:
    x = pointcloud.disc(1.0, n, jax.random.key(1))
    y = pointcloud.disc(2.0, n, jax.random.key(2))

    def mw_cost(scaling):
        return lambda x, y: (
            ot.sinkhorn(x, y, epsilon=eps, threshold=threshold, epsilon_scaling=scaling).reg_ot_cost
        )

    grad = lambda f: jax.grad(f)  # noqa: E731 - the harness jits what it is given
    variants = [
        Variant("memwise", grad(mw_cost(None)), (x, y)),
        Variant("memwise eps-scaling 0.5", grad(mw_cost(0.5)), (x, y)),
        Variant(
            f"ott dense (jax {jax.__version__})",
            grad(lambda x, y: _ott_dense_cost(x, y, eps, threshold)),
            (x, y),
            run=False,
        ),
        Variant(
            "dense jax", grad(lambda x, y: _dense_jax_cost(x, y, eps, threshold)), (x, y), run=False
        ),
    ]
    table = run_table(
        f"gradient of reg_ot_cost, n=m={n:,}", variants, baseline="memwise", time=False
    )
    # One timed solve (+ gradient) per memwise variant: each takes tens of seconds here.
    for scaling, row in ((None, table["rows"][0]), (0.5, table["rows"][1])):
        solve = jax.jit(
            lambda x, y: ot.sinkhorn(
                x, y, epsilon=eps, threshold=threshold, epsilon_scaling=scaling
            )
        )
        jax.block_until_ready(solve(x[:64], y[:64]))
        start = time.perf_counter()
        out = jax.block_until_ready(solve(x, y))
        row["solve_s"] = time.perf_counter() - start
        row["iterations"] = int(out.n_iterations)
        row["s_per_iteration"] = row["solve_s"] / row["iterations"]
        row["converged"] = bool(out.converged)
        row["reg_ot_cost"] = float(out.reg_ot_cost)
    forward = compiled_memory(mw_cost(None), x, y)
    table["rows"][0]["forward_temp_bytes"] = forward.temp_bytes
    online = ott_online(x, y, eps, threshold, run_ott_online)
    row = {
        "variant": f"ott online batch 1000 (jax {online['jax']})",
        "temp_bytes": online["grad"].temp_bytes,
        "peak_bytes": online["grad"].peak_bytes,
        "forward_temp_bytes": online["forward"].temp_bytes,
        "time_s": None,
        "compile_s": online["compile_s"],
        "time_ratio": None,
    }
    if "solve_s" in online:
        row.update(
            solve_s=online["solve_s"],
            iterations=online["iterations"],
            s_per_iteration=online["solve_s"] / online["iterations"],
            converged=online["converged"],
            reg_ot_cost=online["reg_ot_cost"],
        )
        for r in table["rows"][:2]:
            r["solve_speedup_vs_ott_online"] = online["solve_s"] / r["solve_s"]
    table["rows"].append(row)
    return table


def main(quick: bool = False) -> None:
    report_n = 5_000 if quick else 50_000
    compare_n = 2_000 if quick else 20_000
    report = report_case(report_n)
    print(json.dumps(report, indent=1))
    report_table = {
        "title": f"OTT-JAX issue 417 end to end with memwise (n={report_n:,}, grad in x)",
        "baseline": "memwise",
        "rows": [{"variant": "memwise", **report}],
    }
    table = comparison(compare_n, eps=0.1, threshold=1e-3, run_ott_online=True)
    harness.print_table(table)
    save(
        "pointcloud",
        [report_table, table],
        quick=quick,
        notes=(
            "OTT-JAX issue 417 case: peak RSS of the benchmark process after its run (compile "
            "included). "
            "Comparison: compiled temp of the gradient of one Sinkhorn solve's reg_ot_cost; "
            "solve_s is one timed solve after compilation (not interleaved: each takes tens "
            "of seconds on this shared 2-core machine). OTT online runs in a venv pinned to "
            "jax 0.7.2 / ott-jax 0.6.0 since its online mode fails on current jax."
        ),
    )


if __name__ == "__main__":
    harness.cli(main)
