"""``fit(tune=True)``: a local search by measurement, from the cost model's choice.

The cost model orders distant candidates well and neighbouring ones poorly (a 10-20%
cache effect between two mid-size tiles), which is what timing the neighbours settles.
:func:`tune` times the current plan with its untimed neighbours (one candidate away on
one knob, :meth:`memwise.fit.search.Search.neighbours`) that fit, interleaved round by
round (a warm-up and ``tune_runs`` timed runs each), moves to the fastest neighbour by
its fastest run (other work on the machine only adds time) among those faster than the
current plan in most rounds too (a burst of other work slows a few runs), and repeats
until none is faster or ``tune_plans`` plans have been timed. Each plan is compiled once
(the search's memory results are not executables); one that exceeds the budget is
dropped. The compilations and runs are counted apart from the search's.

Timing runs real programs on real (or random) arrays, outside any trace: a fitted
function tuned on its first call under ``jax.jit`` or ``jax.grad`` runs them eagerly,
then returns to the trace with the chosen plan.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from memwise import measure
from memwise.fit.plans import Trial
from memwise.fit.search import Search

__all__ = ["Tuned", "example_data", "tune"]

# What tune returns: the plan kept, the plans timed ((knob values, fastest run's seconds
# in the last round that timed them), fastest first), compilations, timing runs.
Tuned = tuple[Trial, tuple[tuple[tuple, float], ...], int, int]


def example_data(
    args: tuple, kwargs: dict, static_positions: frozenset[int], static_names: frozenset[str]
) -> tuple[tuple, dict]:
    """What ``tune`` runs on: the arguments when concrete, else random arrays like them.

    Static arguments are left out as the compiled executable expects (None in place of
    positional ones). Called outside any trace (see :func:`tune`), so the random arrays
    are concrete too.
    """
    key = [jax.random.PRNGKey(0)]

    def concrete(leaf):
        if isinstance(leaf, (jax.Array, np.ndarray)) and not isinstance(leaf, jax.core.Tracer):
            return leaf
        shape, dtype = jnp.shape(leaf), jnp.result_type(leaf)
        key[0], sub = jax.random.split(key[0])
        if jnp.issubdtype(dtype, jnp.floating):
            # drawn flat: the same values (threefry counts the elements in row-major
            # order) at a fraction of XLA:CPU's compilation, 1-5 s for a rank-3 or -4
            # shape against 0.3 s flat
            return jax.random.normal(sub, (math.prod(shape),), dtype).reshape(shape)
        return jnp.zeros(shape, dtype)

    data_args = tuple(
        None if i in static_positions else jax.tree.map(concrete, a) for i, a in enumerate(args)
    )
    data_kwargs = {k: jax.tree.map(concrete, v) for k, v in kwargs.items() if k not in static_names}
    return data_args, data_kwargs


def tune(
    search: Search,
    chosen: Trial,
    compile_plan: Callable[[tuple[int, ...]], tuple[Any, measure.CompiledMemory]],
    data: Callable[[], tuple[tuple, dict]],
    *,
    tune_plans: int,
    tune_runs: int,
    verbose: bool = False,
) -> Tuned:
    """Times plans around ``chosen`` (see the module docstring); ``compile_plan`` returns a
    plan's executable and memory, ``data`` the arguments to run it on."""
    # Under jax.jit or jax.grad the arguments are tracers, and so would be every array
    # made from them: compile and run outside the trace, on concrete arrays.
    with jax.ensure_compile_time_eval():
        return _tune(search, chosen, compile_plan, data(), tune_plans, tune_runs, verbose)


def _tune(
    search: Search,
    chosen: Trial,
    compile_plan: Callable[[tuple[int, ...]], tuple[Any, measure.CompiledMemory]],
    data: tuple[tuple, dict],
    tune_plans: int,
    tune_runs: int,
    verbose: bool,
) -> Tuned:
    data_args, data_kwargs = data
    executables: dict[tuple[int, ...], Any] = {}
    compilations = runs = 0

    def executable(indices: tuple[int, ...]) -> Any:
        """The compiled plan, or None when its peak exceeds the budget."""
        nonlocal compilations
        if indices not in executables:
            compiled, memory = compile_plan(indices)
            compilations += 1
            search.timed_trial(indices, memory)
            executables[indices] = compiled if memory.peak_bytes <= search.budget_bytes else None
        return executables[indices]

    def time_round(plans: list[tuple[int, ...]]) -> dict[tuple[int, ...], list[float]]:
        nonlocal runs
        samples: dict[tuple[int, ...], list[float]] = {i: [] for i in plans}
        for round_ in range(tune_runs + 1):  # round 0 warms up
            for indices in plans:
                start = time.perf_counter()
                jax.block_until_ready(executables[indices](*data_args, **data_kwargs))
                if round_:
                    samples[indices].append(time.perf_counter() - start)
                runs += 1
        return samples

    current = chosen.indices
    if executable(current) is None:  # pragma: no cover - the search verified it fits
        return chosen, (), compilations, runs
    measured: dict[tuple[int, ...], float] = {}
    while len(measured) < tune_plans:
        fresh: list[tuple[int, ...]] = []
        for candidate in search.neighbours(current):
            if len(measured) + len(fresh) + (current not in measured) >= tune_plans:
                break
            if candidate not in measured and executable(candidate) is not None:
                fresh.append(candidate)
        if not fresh:
            break
        samples = time_round([current, *fresh])
        measured.update({i: min(v) for i, v in samples.items()})
        # A move needs a neighbour faster by its fastest run and in most rounds (its
        # run next to the current plan's): a burst of other work slows a few runs.
        faster = [
            i
            for i in fresh
            if measured[i] < measured[current]
            and 2 * sum(a < b for a, b in zip(samples[i], samples[current])) > len(samples[i])
        ]
        if not faster:
            break
        current = min(faster, key=measured.__getitem__)
    ranked = sorted(measured, key=measured.__getitem__)
    timed = tuple((search.trials[i].values, measured[i]) for i in ranked)
    if verbose:
        for values, seconds in timed:
            knob_text = ", ".join(f"{k.kind}={v!s}" for k, v in zip(search.layout, values))
            print(
                f"mw.fit: timed plan {knob_text or 'no knobs'}: {seconds * 1e3:.2f} ms "
                f"(fastest of {tune_runs} runs)",
                flush=True,
            )
    return search.trials[current], timed, compilations, runs
