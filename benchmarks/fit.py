"""Benchmark ``fit``: every knob "auto", budgets from generous to tight, vs hand-picked.

For each problem (lstm, pointcloud, kip) the function is written once with every memory
knob left as ``"auto"``. Hand-picked settings are every candidate combination of those
knobs (remat policy left at "save everything"), compiled and timed; the budgets run
geometrically from the smallest peak any of them reaches to the fastest setting's peak.
For each budget ``mw.fit`` plans from a cold cache (planning time and compile count),
once with its cost model alone and once with ``tune=True`` (a local search by
measurement from the model's choice: the plan and its neighbours that fit, one candidate
away on one knob, compiled and timed 5 times each, then the fastest one's neighbours, at
most 6 plans, counted apart; a move needs a neighbour faster by its fastest run and in
most rounds), its program's compiled
peak is checked against the budget, and its wall time is compared with the fastest
hand-picked setting whose peak fits the same budget, all timed interleaved in one run
(15 rounds; the fastest run of each program, since one compiled program timed against
itself varies by 10-40% from run to run on this machine and other work only adds time).
A plan that lowers to the very program of a hand-picked setting (the same StableHLO) is
timed as that setting ("timed as"): two copies of one program differed by up to 20%
here, which says nothing about the plan. Every program is ``jax.grad`` of the loss, the
program ``mw.fit`` plans. The cost model of the chunked primitives is a roofline: XLA's
cost analysis of one tile body and the machine's measured balance, measured on the quiet
machine just before the run. The machine is a 2-core CPU (nothing else ran during this
run).
"""

from __future__ import annotations

import itertools
import re
import time

import harness
import jax
import jax.numpy as jnp

import memwise as mw
from memwise import costmodel, knobs
from memwise.measure import compile_measured, format_bytes


def lstm_problem(quick: bool):
    from memwise.scenarios import lstm

    size = dict(
        batch=10,
        seq_length=500 if quick else 2000,
        hidden=64,
        input_dim=16,
        output_dim=4,
        seq2seq=False,
    )
    net = lstm.model(
        "memwise",
        hidden=size["hidden"],
        output_dim=size["output_dim"],
        seq2seq=size["seq2seq"],
        checkpoints="auto",
    )
    x, y = lstm.data(
        size["batch"], size["seq_length"], size["input_dim"], size["output_dim"], size["seq2seq"]
    )
    params = net.init(jax.random.PRNGKey(0), x[:, :2])["params"]
    loss = lstm.loss_fn(net)
    title = (
        f"lstm: Flax LSTM, T={size['seq_length']}, batch {size['batch']}, hidden "
        f"{size['hidden']}, memwise.flax.scan(checkpoints='auto')"
    )
    return title, loss, (params, x, y)


def pointcloud_problem(quick: bool):
    from memwise.scenarios import pointcloud

    n = 2000 if quick else 4000
    x, y = pointcloud.report_clouds(n)

    def loss(x, y):
        return mw.ot.sinkhorn_divergence(x, y, chunk_size="auto")

    title = f"pointcloud: Sinkhorn divergence, OTT-JAX issue 417 discs, n=m={n}, chunk_size='auto'"
    return title, loss, (x, y)


def kip_problem(quick: bool):
    from memwise.ntk import kernels

    kernel_fn = kernels.serial(
        kernels.Conv((3, 3)),
        kernels.Relu(),
        kernels.Conv((3, 3)),
        kernels.Relu(),
        kernels.Flatten(),
        kernels.Dense(),
    )
    n_support, n_target, side = 10, (200 if quick else 1000), 14
    key = jax.random.PRNGKey(0)
    ks, kt, kl = jax.random.split(key, 3)
    x_support = jax.random.normal(ks, (n_support, side, side, 1))
    y_support = jax.nn.one_hot(jnp.arange(n_support) % 10, 10)
    x_target = jax.random.normal(kt, (n_target, side, side, 1))
    y_target = jax.nn.one_hot(jax.random.randint(kl, (n_target,), 0, 10), 10)

    def loss(x_support, y_support, x_target, y_target):
        return mw.ntk.kip_loss(
            kernel_fn, x_support, y_support, x_target, y_target, ridge=1e-3, chunk_size="auto"
        )

    title = (
        f"kip: 2-layer conv NTK, {n_support} support, {n_target} targets "
        f"{side}x{side}, chunk_size='auto'"
    )
    return title, loss, (x_support, y_support, x_target, y_target)


PROBLEMS = {"lstm": lstm_problem, "pointcloud": pointcloud_problem, "kip": kip_problem}


def _layout(loss, args):
    """The knobs one trace of ``loss`` reaches (as ``mw.fit`` records them)."""
    with knobs.recording() as found:
        jax.eval_shape(loss, *args)
    return list(found)


def _hand_picked(loss, layout, indices):
    def program(*args):
        with knobs.recording(indices, layout):
            return jax.grad(loss)(*args)

    return program


def _program_text(program, args) -> str:
    """The program as JAX lowers it, but for its module's name."""
    text = jax.jit(program).lower(*args).as_text()
    return re.sub(r"module @\S+", "module @program", text, count=1)


def _problem_table(name: str, quick: bool) -> dict:
    title, loss, args = PROBLEMS[name](quick)
    layout = _layout(loss, args)
    grid = list(itertools.product(*(range(len(k.candidates)) for k in layout)))
    hand = []
    for indices in harness.progress(grid, desc=f"{name}: hand-picked"):
        program = _hand_picked(loss, layout, indices)
        _, memory = compile_measured(program, *args)
        values = ", ".join(str(k.candidates[i]) for k, i in zip(layout, indices))
        hand.append((f"hand: {values}", program, memory.peak_bytes))
    peaks = sorted({p for _, _, p in hand})
    low, high = peaks[0], hand[0][2]  # leanest reachable, fastest setting's peak
    n_budgets = 3 if quick else 5
    budgets = (
        sorted({int(low * (high / low) ** (i / (n_budgets - 1))) + 1 for i in range(n_budgets)})
        if high > low
        else [high]
    )

    fitted_rows = []
    for budget, tune in itertools.product(budgets, (False, True)):
        fresh = lambda *a, _loss=loss: _loss(*a)  # noqa: E731 - a cold plan cache per budget
        start = time.perf_counter()
        fitted = mw.fit(fresh, budget=budget, tune=tune)
        try:
            plan = fitted.plan_for(*args)
        except mw.MemoryBudgetError as error:
            fitted_rows.append({"budget": budget, "tune": tune, "error": str(error)})
            continue
        planning_s = time.perf_counter() - start
        _, memory = compile_measured(jax.grad(fitted), *args)
        fitted_rows.append(
            {
                "budget": budget,
                "tune": tune,
                "planning_s": planning_s,
                "compilations": plan.compilations,
                "tuning": (
                    f"{plan.tuning_compilations} + {plan.timing_runs} runs" if tune else "-"
                ),
                "peak": memory.peak_bytes,
                "plan": ", ".join(f"{e.value}" for e in plan.entries),
                "program": jax.grad(fitted),
            }
        )

    variants = [
        harness.Variant(label, program, args, extra={"kind": "hand-picked"})
        for label, program, _ in hand
    ]
    # A plan that lowers to a hand-picked setting's very program is that program: timing
    # a second copy would measure only run-to-run noise (up to 20% here), not the plan.
    texts = {_program_text(program, args): label for label, program, _ in hand}
    for row in fitted_rows:
        if "program" in row:
            row["label"] = f"fit{' tune' if row['tune'] else ''} {format_bytes(row['budget'])}"
            row["same as"] = texts.get(_program_text(row["program"], args))
            variants.append(
                harness.Variant(
                    row["label"],
                    row["program"],
                    args,
                    run=row["same as"] is None,
                    extra={
                        "kind": "fit, tune=True" if row["tune"] else "fit",
                        "budget": format_bytes(row["budget"]),
                        "plan": row["plan"],
                        "planning s": round(row["planning_s"], 1),
                        "compilations": row["compilations"],
                        "tuning compilations + timing runs": row["tuning"],
                        "budget met": "yes" if row["peak"] <= row["budget"] else "NO",
                    },
                )
            )
    table = harness.run_table(
        title,
        variants,
        baseline=variants[0].name,
        quick=quick,
        repeats=3 if quick else 15,
        statistic="min",
    )
    table["failures"] = [
        f"fit{' tune' if row['tune'] else ''} {format_bytes(row['budget'])}: no plan "
        f"({row['error'].splitlines()[0]})"
        for row in fitted_rows
        if "error" in row
    ]
    by_name = {r["variant"]: r for r in table["rows"]}
    for row in fitted_rows:
        if "program" not in row:
            continue
        fit_row = by_name[row["label"]]
        if row["same as"] is not None:
            same = by_name[row["same as"]]
            fit_row["time_s"], fit_row["time_ratio"] = same["time_s"], same["time_ratio"]
            fit_row["timed as"] = row["same as"]
        fitting = [by_name[label] for label, _, peak in hand if peak <= row["budget"]]
        best = min(fitting, key=lambda r: r["time_s"])
        fit_row["best hand-picked"] = best["variant"].removeprefix("hand: ")
        fit_row["time / best hand-picked"] = round(fit_row["time_s"] / best["time_s"], 3)
    return table


def main(quick: bool = False, names=None) -> None:
    costmodel.machine(refresh=True)  # the balance of this machine now, not a cached one
    tables = []
    for name in names or PROBLEMS:
        table = _problem_table(name, quick)
        harness.print_table(table)
        tables.append(table)
    harness.save("fit", tables, notes=__doc__.split("\n\n")[1].replace("\n", " "), quick=quick)


if __name__ == "__main__":
    harness.cli(main)
