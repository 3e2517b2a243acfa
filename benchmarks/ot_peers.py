"""Benchmark ``ot_peers``: CPU Sinkhorn speed of memwise beside the libraries a user would
pick instead (POT, GeomLoss, OTT-JAX), and whose gradient fits at n = m = 50,000.

Every library solves one problem: uniform weights on two Gaussian clouds (``x ~ N(0,
I/d)``, ``y`` shifted by ``0.5/sqrt(d)`` per coordinate), the cost ``|x - y|^2``, one
absolute epsilon, float32. memwise runs twice: chunked (its default, the baseline of
every ratio) and with ``chunk_size=None`` (the cost matrix held for the solve, as OTT-JAX
dense holds it). In each library's convention: memwise ``epsilon`` and OTT-JAX
``PointCloud(epsilon=)`` as they are (OTT's dense geometry: its online ``batch_size``
mode does not compile on this jax, see the gradient table); POT ``reg`` (lazy
``ot.bregman.empirical_sinkhorn`` for fixed counts, ``ot.solve_sample(lazy=True)`` to the
threshold, batches of 1,000 rows); GeomLoss ``SamplesLoss("sinkhorn", p=2,
debias=False)``, online (KeOps) with the cost formula ``"SqDist(X,Y)"`` and ``blur =
sqrt(eps)`` (``eps = blur**p``), tensorized with its own cost ``|x - y|^2 / 2`` and
``blur = sqrt(eps / 2)`` (half the cost at half the epsilon: the same plan).

Time per iteration: two fixed iteration counts per library, interleaved round by round
after a warm-up (JAX compiled ahead of time and run once at every size, KeOps formulas
built), the difference of the median times over the difference of the counts. GeomLoss
runs its epsilon schedule replaced by ``[eps] * K`` (one symmetric update of both
potentials per entry); OTT runs multiples of 10 (it checks the marginal every 10
iterations); POT runs 2 and 4, below its every-10 check (~5% of its time left out). Time
to threshold: one solve to an L1 marginal error of 1e-3 (GeomLoss has no such rule and
runs its default annealing, ``scaling=0.5``); the marginal error of every solve's
potentials is then re-measured here in one convention (``P = a b^T exp((f + g - C) /
eps)``, both marginals' L1 errors added). A POT or GeomLoss measurement estimated over
``CAP_S`` (from the smallest size, times (n / n_0)^2) is not run and says so.

At n = m = 50,000 the gradient in ``x`` of the regularized OT cost is compiled (not run)
for memwise and OTT-JAX and its ``memory_analysis()`` read; for POT and GeomLoss the row
says what they would hold by construction.

Threads: every library on the same cores (the CPU affinity, ``MEMWISE_PEERS_THREADS``,
default all): XLA's pool follows the affinity, torch gets ``set_num_threads``, BLAS and
KeOps' OpenMP ``OMP_NUM_THREADS``. The load average is saved with the results.

The peers live in ``benchmarks/.venv-peers`` (git-ignored, ~6 GB with torch), made and
run by ``make bench-peers``; by hand::

    python3 -m venv benchmarks/.venv-peers
    benchmarks/.venv-peers/bin/pip install jax==0.10.2 ott-jax pot geomloss torch pykeops tqdm
    benchmarks/.venv-peers/bin/pip install --no-deps -e .
    python -m benchmarks ot_peers

Without it, ``python -m benchmarks`` skips this benchmark with a message.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEERS_VENV = HERE / ".venv-peers"
PEERS = ("ot", "geomloss", "torch", "pykeops", "ott")
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")

EPSILON = 0.1
THRESHOLD = 1e-3
MAX_ITERATIONS = 2000
POT_BATCH = 1000
CAP_S = 60.0  # the longest one measurement may be estimated to take, in seconds
GRAD_N = 50_000
BUDGET_BYTES = 24 * 2**30  # this machine's memory
GIB = 2**30


def _peer_python() -> str | None:
    """An interpreter with every peer library: this one, or the peers venv's."""
    check = "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in %r))"
    for python in (sys.executable, str(PEERS_VENV / "bin" / "python")):
        if Path(python).exists():
            if (
                subprocess.run([python, "-c", check % (PEERS,)], capture_output=True).returncode
                == 0
            ):
                return python
    return None


def main(quick: bool = False) -> None:
    """Runs the measurement in a child process of the peers' interpreter (so the thread
    counts are set before NumPy, torch and XLA start), or skips with a message."""
    python = _peer_python()
    if python is None:
        print(
            "ot_peers: skipped: POT, GeomLoss, torch, pykeops or OTT-JAX is not installed; "
            "make the peers' environment with `make bench-peers` (see benchmarks/ot_peers.py)"
        )
        return
    threads = os.environ.get("MEMWISE_PEERS_THREADS") or str(len(os.sched_getaffinity(0)))
    env = {**os.environ, "MEMWISE_PEERS_THREADS": threads, "JAX_PLATFORMS": "cpu"}
    env.update(dict.fromkeys(THREAD_VARS, threads))
    command = [python, str(Path(__file__)), "--child"] + (["--quick"] if quick else [])
    subprocess.run(command, env=env, check=True)


# --- the child: everything below runs in the peers' interpreter ----------------------


def clouds(n: int, d: int):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, d)) / np.sqrt(d)
    y = rng.standard_normal((n, d)) / np.sqrt(d) + 0.5 / np.sqrt(d)
    return x.astype(np.float32), y.astype(np.float32)


class Solver:
    """One library: ``fixed(K)`` runs K iterations, ``to_threshold()`` one solve; both
    return ``(f, g, iterations, value)``, potentials in memwise's convention."""

    name = ""
    counts = (10, 20)  # the two fixed iteration counts
    overhead = 1  # iteration-equivalents each call costs beyond its iterations
    iterations = 50  # a guess of the iterations to threshold, before one is measured
    compile_s = 0.0


class JaxSolver(Solver):
    """memwise or OTT-JAX: compiled ahead of time, so no run pays for compilation."""

    def __init__(self, name, solve, x, y, counts):
        import jax.numpy as jnp

        self.name, self.solve, self.counts = name, solve, counts
        self.x, self.y = jnp.asarray(x), jnp.asarray(y)
        self.temp_bytes = None

    def _compiled(self, **kwargs):
        import jax

        start = time.perf_counter()
        exe = jax.jit(lambda x, y: self.solve(x, y, **kwargs)).lower(self.x, self.y).compile()
        self.compile_s += time.perf_counter() - start
        mem = exe.memory_analysis()
        self.temp_bytes = int(mem.temp_size_in_bytes) if mem is not None else None

        def run():
            f, g, it, value = jax.block_until_ready(exe(self.x, self.y))
            return f, g, int(it), float(value)

        return run

    def fixed(self, iterations):
        return self._compiled(iterations=iterations, threshold=None)

    def to_threshold(self):
        return self._compiled(iterations=None, threshold=THRESHOLD)


def memwise_solve(x, y, *, iterations, threshold, chunk_size="auto"):
    import memwise as mw

    out = mw.ot.sinkhorn(
        x,
        y,
        epsilon=EPSILON,
        chunk_size=chunk_size,
        max_iterations=iterations or MAX_ITERATIONS,
        threshold=threshold or 1e-30,  # never reached: a fixed count
    )
    return out.f, out.g, out.n_iterations, out.reg_ot_cost


def held_solve(x, y, *, iterations, threshold):
    """memwise holding the n x m cost matrix for the solve (OTT-JAX's ``batch_size=None``)."""
    return memwise_solve(x, y, iterations=iterations, threshold=threshold, chunk_size=None)


def ott_solve(x, y, *, iterations, threshold, batch_size=None):
    import jax.numpy as jnp
    from ott.geometry import pointcloud
    from ott.problems.linear import linear_problem
    from ott.solvers.linear import sinkhorn

    geom = pointcloud.PointCloud(x, y, epsilon=EPSILON, batch_size=batch_size)
    if iterations is None:
        solver = sinkhorn.Sinkhorn(threshold=threshold, max_iterations=MAX_ITERATIONS)
    else:
        solver = sinkhorn.Sinkhorn(
            threshold=-1.0, min_iterations=iterations, max_iterations=iterations
        )
    out = solver(linear_problem.LinearProblem(geom))
    # OTT's plan is exp((f + g - C) / eps): its potentials hold eps log(a), eps log(b).
    n, m = x.shape[0], y.shape[0]
    f, g = out.f + EPSILON * jnp.log(n), out.g + EPSILON * jnp.log(m)
    return f, g, out.n_iters, out.reg_ot_cost


class PotSolver(Solver):
    name = "POT lazy (NumPy)"
    counts = (2, 4)  # below its every-10 check of the marginal: ~5% in POT's favour
    overhead = 0

    def __init__(self, x, y):
        self.x, self.y = x, y

    def _convert(self, u, v):
        import numpy as np

        # POT's lazy potentials are log-scalings: P = exp(u + v - C / reg).
        n, m = len(u), len(v)
        return EPSILON * (np.asarray(u) + np.log(n)), EPSILON * (np.asarray(v) + np.log(m))

    def fixed(self, iterations):
        import ot

        def run():
            u, v = ot.bregman.empirical_sinkhorn(
                self.x,
                self.y,
                EPSILON,
                isLazy=True,
                batchSize=POT_BATCH,
                numIterMax=iterations,
                stopThr=-1.0,
                warn=False,
            )
            return (*self._convert(u, v), iterations, None)

        return run

    def to_threshold(self):
        import ot

        def run():
            res = ot.solve_sample(
                self.x,
                self.y,
                reg=EPSILON,
                lazy=True,
                batch_size=POT_BATCH,
                tol=THRESHOLD,
                max_iter=MAX_ITERATIONS,
            )
            u, v = res.potentials
            return (*self._convert(u, v), int(res.log["niter"]) + 1, None)

        return run


class GeomLossSolver(Solver):
    """``SamplesLoss("sinkhorn")``; fixed counts replace its epsilon schedule."""

    counts = (1, 2)
    overhead = 2  # its first and last (extrapolation) updates
    iterations = 10  # its annealing schedule's length at these sizes

    def __init__(self, backend, x, y):
        import torch

        self.backend = backend
        # Tensorized calls start by building the cost matrices: more iterations to time.
        self.counts = (1, 2) if backend == "online" else (2, 10)
        self.name = f"GeomLoss {backend}" + (" (KeOps)" if backend == "online" else " (torch)")
        self.x, self.y = torch.from_numpy(x), torch.from_numpy(y)
        # online: the cost |x - y|^2 as a KeOps formula; tensorized: GeomLoss' |x - y|^2 / 2.
        self.scale = 1.0 if backend == "online" else 2.0
        self.kwargs = dict(
            p=2,
            blur=(EPSILON / self.scale) ** 0.5,
            debias=False,
            potentials=True,
            backend=backend,
            **({"cost": "SqDist(X,Y)"} if backend == "online" else {}),
        )

    def _run(self, schedule):
        import geomloss
        import geomloss._legacy.sinkhorn_divergence as divergence

        original = divergence.epsilon_schedule
        used = []

        def patched(p, diameter, blur, scaling):
            used.append(schedule(p, diameter, blur, scaling, original))
            return used[-1]

        divergence.epsilon_schedule = patched
        try:
            f, g = geomloss.SamplesLoss("sinkhorn", **self.kwargs)(self.x, self.y)
        finally:
            divergence.epsilon_schedule = original
        f, g = self.scale * f.numpy().ravel(), self.scale * g.numpy().ravel()
        return f, g, len(used[-1]), None

    def fixed(self, iterations):
        return lambda: self._run(lambda p, diameter, blur, scaling, _: [blur**p] * iterations)

    def to_threshold(self):
        return lambda: self._run(lambda *args: args[-1](*args[:-1]))  # its own schedule


def check(x, y, f, g) -> tuple[float, float]:
    """Both marginals' L1 errors of ``P = a b^T exp((f + g - C) / eps)`` (uniform a, b),
    and the dual value ``<a, f> + <b, g>`` (the regularized OT cost once converged)."""
    import jax
    import jax.numpy as jnp

    import memwise as mw

    @jax.jit
    def error(x, y, f, g):
        n, m = x.shape[0], y.shape[0]

        def score(xi, yj):
            return -jnp.sum((xi - yj) ** 2) / EPSILON

        rows = mw.pairwise_reduce(score, x, y, reduce="logsumexp", weights=g / EPSILON - jnp.log(m))
        cols = mw.pairwise_reduce(
            score, x, y, reduce="logsumexp", weights=f / EPSILON - jnp.log(n), axis=0
        )
        row_err = jnp.sum(jnp.abs(jnp.expm1(f / EPSILON + rows))) / n
        col_err = jnp.sum(jnp.abs(jnp.expm1(g / EPSILON + cols))) / m
        return row_err + col_err, jnp.mean(f) + jnp.mean(g)

    arrays = [jnp.asarray(v, jnp.float32) for v in (x, y, f, g)]
    return tuple(float(v) for v in error(*arrays))


def solvers(x, y, names=None) -> list[Solver]:
    every = [
        JaxSolver("memwise", memwise_solve, x, y, (5, 10)),
        JaxSolver("memwise chunk_size=None", held_solve, x, y, (5, 10)),
        JaxSolver("OTT-JAX dense", ott_solve, x, y, (10, 20)),  # it checks every 10
        PotSolver(x, y),
        GeomLossSolver("online", x, y),
        GeomLossSolver("tensorized", x, y),
    ]
    return [s for s in every if names is None or s.name in names]


def case(n: int, d: int, *, rounds: int, estimates: dict | None, base: int) -> tuple:
    """One size: time per iteration and time to threshold of every library.

    ``estimates``: seconds per iteration and iterations to threshold measured at ``base``
    points (None at ``base`` itself, where a timed warm-up gives the estimate). A
    measurement of POT or GeomLoss estimated over ``CAP_S`` is not run. Returns the rows
    and what was measured."""
    x, y = clouds(n, d)
    scale = (n / base) ** 2
    rows, measured = [], {}
    for solver in solvers(x, y):
        row = {"variant": solver.name, "n": n, "d": d}
        rows.append(row)
        capped = not isinstance(solver, JaxSolver)
        k1, k2 = solver.counts
        first, second = solver.fixed(k1), solver.fixed(k2)
        if estimates is None:  # warm-up: KeOps builds its formula, NumPy and torch allocate
            start = time.perf_counter()
            first()
            guess = (time.perf_counter() - start) / (k1 + solver.overhead)
        else:
            guess = estimates.get(solver.name, 0.0) * scale
            if not capped:  # a JAX executable's first call maps its buffers (GiB here)
                first()
        plan = guess * (k1 + k2 + 2 * solver.overhead)
        if capped and plan > CAP_S:
            row["s_per_iteration"] = f"not run: est. {guess:.3g}"
            measured[solver.name] = guess / scale
            continue
        times: dict[int, list[float]] = {k1: [], k2: []}
        for _ in range(rounds if not capped or plan * rounds <= CAP_S else 1):
            for k, run in ((k1, first), (k2, second)):
                start = time.perf_counter()
                run()
                times[k].append(time.perf_counter() - start)
        seconds = (statistics.median(times[k2]) - statistics.median(times[k1])) / (k2 - k1)
        measured[solver.name] = seconds / scale
        row.update(s_per_iteration=seconds, counts=f"{k1}, {k2}")
        iterations = (estimates or {}).get(f"{solver.name} iterations", solver.iterations)
        if capped and seconds * (iterations + solver.overhead) > CAP_S:
            row["solve_s"] = f"not run: est. {seconds * iterations:.3g}"
            continue
        solve = solver.to_threshold()
        start = time.perf_counter()
        f, g, iterations, _ = solve()
        elapsed = time.perf_counter() - start
        error, value = check(x, y, f, g)
        row.update(solve_s=elapsed, iterations=iterations, marginal_error=error, value=value)
        measured[f"{solver.name} iterations"] = iterations
        if isinstance(solver, JaxSolver):
            row.update(compile_s=solver.compile_s, temp_bytes=solver.temp_bytes)
    mw_seconds = rows[0].get("s_per_iteration")  # memwise's
    for row in rows:
        if isinstance(row.get("s_per_iteration"), float) and isinstance(mw_seconds, float):
            row["vs_memwise"] = row["s_per_iteration"] / mw_seconds
    return rows, measured


def gradients(n: int, d: int, per_iteration: dict, base: int) -> list[dict]:
    """Compiled gradient memory at n = m (memwise, OTT) and what the others would need."""
    import jax

    from memwise.measure import compiled_memory

    x, y = (jax.numpy.asarray(a) for a in clouds(n, d))
    matrix, keops = n * n * 4, per_iteration.get("GeomLoss online (KeOps)")
    rows = []
    for name, batch_size, solve in (
        ("memwise", None, memwise_solve),
        ("memwise chunk_size=None", None, held_solve),
        ("OTT-JAX dense", None, ott_solve),
        ("OTT-JAX online (batch_size=1000)", 1000, ott_solve),
    ):
        kwargs = dict(iterations=None, threshold=THRESHOLD)
        if batch_size:
            kwargs["batch_size"] = batch_size
        try:
            memory = compiled_memory(lambda x, y: solve(x, y, **kwargs)[3], x, y, grad=True)
        except Exception as error:  # noqa: BLE001 - recorded in the table
            message = str(error).strip().splitlines()[0][:160]
            found = f"does not compile on jax {jax.__version__}: {type(error).__name__}: {message}"
            rows.append({"variant": name, "gradient": found})
            continue
        rows.append(
            {
                "variant": name,
                "gradient": "compiled (memory_analysis)",
                "temp_bytes": memory.temp_bytes,
                "peak_bytes": memory.peak_bytes,
                "fits_24GiB": memory.peak_bytes <= BUDGET_BYTES,
            }
        )
    online = f"est. {keops * (n / base) ** 2:.3g} s per iteration here" if keops else "no time"
    rows += [
        {
            "variant": "POT lazy (NumPy)",
            "gradient": "none in x (the lazy loop builds the cost from NumPy copies); "
            f"the dense solver needs the {matrix / GIB:.1f} GiB cost matrix",
        },
        {
            "variant": "GeomLoss tensorized (torch)",
            "gradient": f"holds two dense n x m matrices, {2 * matrix / GIB:.1f} GiB, and a "
            "third as the softmin's temporary",
            "fits_24GiB": 3 * matrix <= BUDGET_BYTES,
        },
        {
            "variant": "GeomLoss online (KeOps)",
            "gradient": f"O(n + m) memory (KeOps reductions); not run: {online}",
            "fits_24GiB": True,
        },
    ]
    return [{**row, "n": n, "d": d} for row in rows]


CASE_COLUMNS = [
    ["variant", "library"],
    ["s_per_iteration", "s / iteration"],
    ["vs_memwise", "/ memwise"],
    ["counts", "counts"],
    ["solve_s", "s to 1e-3"],
    ["iterations", "iterations"],
    ["marginal_error", "error"],
    ["value", "<a, f> + <b, g>"],
    ["temp_bytes", "compiled temp"],
]
GRAD_COLUMNS = [
    ["variant", "library"],
    ["d", "d"],
    ["gradient", "gradient"],
    ["temp_bytes", "temp"],
    ["peak_bytes", "peak"],
    ["fits_24GiB", "fits 24 GiB"],
]


def summary(cases: list[dict]) -> dict:
    """Time per iteration over memwise's, one row per library, one column per size."""
    columns, rows = [["variant", "library"]], {}
    for table in cases:
        key = f"n{table['n']}_d{table['d']}"
        columns.append([key, f"n={table['n']:,} d={table['d']}"])
        for row in table["rows"]:
            entry = rows.setdefault(row["variant"], {"variant": row["variant"]})
            ratio = row.get("vs_memwise")
            entry[key] = f"{ratio:.2f}x" if ratio is not None else "not run"
    return {
        "title": "time per Sinkhorn iteration / memwise's (lower is faster)",
        "baseline": "memwise",
        "columns": columns,
        "rows": list(rows.values()),
    }


def child(quick: bool) -> None:
    """The measurement; ``results/ot_peers.json`` is rewritten after every table, so a
    run cut short keeps what it measured (and says so)."""
    import torch

    threads = int(os.environ["MEMWISE_PEERS_THREADS"])
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:threads])
    torch.set_num_threads(threads)
    sizes = (500, 1000) if quick else (5_000, 20_000)
    grad_n = 2_000 if quick else GRAD_N
    load, start = [os.getloadavg()], time.perf_counter()
    tables, estimates = [], {}
    for n in sizes:
        for d in (3, 64):
            rounds = 1 if quick or n > sizes[0] else 2
            rows, measured = case(n, d, rounds=rounds, estimates=estimates.get(d), base=sizes[0])
            estimates.setdefault(d, measured)  # the smallest size's, for the larger
            title = f"Sinkhorn, n=m={n:,}, d={d}, epsilon={EPSILON}, float32"
            tables.append({"title": title, "baseline": "memwise", "n": n, "d": d})
            tables[-1].update(columns=CASE_COLUMNS, rows=rows)
            load.append(os.getloadavg())
            _save(tables, threads, load, time.perf_counter() - start, quick, done=False)
    grads = [r for d in (3, 64) for r in gradients(grad_n, d, estimates[d], sizes[0])]
    title = f"gradient in x of the regularized OT cost, n=m={grad_n:,}"
    tables.append({"title": title, "baseline": "memwise", "columns": GRAD_COLUMNS, "rows": grads})
    load.append(os.getloadavg())
    _save(tables, threads, load, time.perf_counter() - start, quick, done=True)


def _save(tables, threads, load, seconds, quick, *, done):
    import json

    import geomloss
    import harness
    import ot
    import pykeops
    import torch

    harness.print_table(tables[-1])
    versions = {
        "POT": ot.__version__,
        "geomloss": geomloss.__version__,
        "torch": torch.__version__,
        "pykeops": pykeops.__version__,
    }
    notes = (
        ("" if done else "**Cut short: the run stopped after the last table below.** ")
        + f"Same problem in every library: uniform weights, cost |x - y|^2, epsilon {EPSILON} "
        f"(POT reg={EPSILON}; GeomLoss online blur=sqrt({EPSILON}) with cost SqDist(X,Y), "
        f"tensorized blur=sqrt({EPSILON}/2) with its cost |x - y|^2/2), threshold "
        f"{THRESHOLD} on the L1 marginal error, float32. {threads} thread(s) for every "
        f"library (CPU affinity, torch.set_num_threads, OMP/OpenBLAS threads). "
        f"s / iteration: difference of the median times of two fixed iteration counts "
        f"(`counts`) over their difference, {2 if not quick else 1} interleaved rounds at "
        f"the smallest size, one at the larger; `s to 1e-3`: one solve to the threshold "
        f"(GeomLoss: its default annealing, scaling 0.5, no threshold option); `error`: "
        f"both marginals' L1 error of the returned potentials, re-measured in one "
        f"convention. `not run`: estimated over {CAP_S:.0f} s from the smallest size. "
        f"OTT-JAX runs its dense geometry (the cost matrix stored once). Load average "
        f"(1, 5, 15 min) before and after each table: "
        + "; ".join(", ".join(f"{v:.1f}" for v in a) for a in load)
        + f". Total {seconds:.0f} s. Versions: "
        + ", ".join(f"{k} {v}" for k, v in versions.items())
        + "."
    )
    cases = [t for t in tables if "n" in t]
    path = harness.save("ot_peers", [summary(cases), *tables], notes=notes, quick=quick)
    payload = json.loads(path.read_text())
    payload["machine"]["versions"].update(versions)
    payload.update(threads=threads, load_average=load, complete=done)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    if "--child" in sys.argv:
        child(quick="--quick" in sys.argv)
    else:
        import harness

        harness.cli(main)
