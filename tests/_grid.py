"""Sampled conformance grids and a sampled slow tier, as JAX's own suite samples its
parametrized cases (``JAX_NUM_GENERATED_CASES``) and runs the rest in a fuller lane.

A test marked ``grid`` (a parametrized conformance grid: the dtype x transformation
matrix, the ported neural-tangents and Diffrax suites) runs a deterministic, stratified
sample of its cases in ``make test`` and every case under ``make test-full``. Of the other
tests marked ``slow`` (larger compilations: memory at two sizes, peers at their own sizes,
several devices in a subprocess, the documentation's examples), ``make test`` runs a
seeded :data:`SLOW_FRACTION` of each file's on average (:func:`sample_slow`: of ``n``,
``floor(0.06 n)`` and one more with probability ``frac(0.06 n)``, so a file's few heavy
slow tests do not run one every time), and at least one where the file has no other
test: every file runs in CI and every slow test has a chance in every run;
``make test-full`` runs them all. The fast lane (``-m "not slow"``) and every doctest
always run.

- ``MEMWISE_TEST_GRID=full`` runs every case; ``sample`` (the default) runs a sample.
- ``MEMWISE_TEST_SEED`` chooses the sample. Unset, the suite draws one and prints it in
  the run's header (``grids and slow tests: sampled, seed ...``), so a failing sample is reproduced by
  setting it; the workers of one run read the seed the controller drew.

The sample is stratified: each value of each parameter of a test appears in at least one
chosen case (every primitive, every dtype, every transformation), then cases are added
in the seed's order up to the grid's ``fraction`` (``@pytest.mark.grid(fraction=0.3)``,
:data:`DEFAULT_FRACTION` otherwise). A value is told apart by itself when it is a
string, number, bool or None; a tuple (a product of sizes) or a dict (a ported suite's
case) by each of its entries; a class or function by its name; anything else by its
``repr``, or by its position in the ``parametrize`` list where the ``repr`` holds an
address (which differs between worker processes).
"""

from __future__ import annotations

import itertools
import math
import os
import random
from collections.abc import Hashable, Sequence

DEFAULT_FRACTION = 0.25
SLOW_FRACTION = 0.06
_PLAIN = (str, int, float, bool, type(None))


def mode() -> str:
    """``"full"`` or ``"sample"``, from ``MEMWISE_TEST_GRID``."""
    value = os.environ.get("MEMWISE_TEST_GRID", "sample")
    if value not in ("full", "sample"):
        raise ValueError(f"MEMWISE_TEST_GRID must be 'full' or 'sample', got {value!r}")
    return value


def seed() -> int:
    """The run's seed: ``MEMWISE_TEST_SEED``, drawn and exported when unset (the
    controller draws it before its workers start; they inherit the environment)."""
    if "MEMWISE_TEST_SEED" not in os.environ:
        os.environ["MEMWISE_TEST_SEED"] = str(random.SystemRandom().randrange(10_000))
    return int(os.environ["MEMWISE_TEST_SEED"])


def strata(params: dict, indices: dict) -> frozenset[Hashable]:
    """The (parameter, value) pairs of one case; a dict value (a ported suite's case)
    gives one pair per key, a tuple value (a product of sizes) one per position."""
    pairs = set()
    for name, value in params.items():
        if isinstance(value, dict):
            pairs |= {(f"{name}.{k}", _plain(v, "?")) for k, v in value.items()}
        elif isinstance(value, tuple):
            pairs |= {(f"{name}[{i}]", _plain(v, "?")) for i, v in enumerate(value)}
        else:
            pairs.add((name, _plain(value, _name(value, indices.get(name)))))
    return frozenset(pairs)


def _name(value, index) -> str:
    """A class or function by its name (a dtype such as ``jnp.float32``), another object
    by its ``repr`` unless that holds an address, else by its position."""
    name = getattr(value, "__qualname__", None) or repr(value)
    return f"#{index}" if " at 0x" in name else name


def _plain(value, otherwise: str) -> Hashable:
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (tuple, list)):
        return tuple(_plain(v, otherwise) for v in value)
    return otherwise


def sample(cases: Sequence[frozenset], fraction: float, key: str) -> list[int]:
    """Positions of the chosen cases, in their original order.

    Every (parameter, value) pair in ``cases`` is covered by a chosen case, in few cases:
    each next one is the case that covers the most pairs not yet covered (the greedy set
    cover; ties go to the earlier case in a shuffled order seeded by the run's seed and
    ``key``, the test's name). Then cases are added in that order until
    ``ceil(fraction * len(cases))`` are chosen.
    """
    order = list(range(len(cases)))
    random.Random(f"{seed()}:{key}").shuffle(order)
    chosen: list[int] = []
    covered: set = set()
    while True:
        best = max(order, key=lambda i: len(cases[i] - covered))  # the first of the best
        if cases[best] <= covered:
            break
        chosen.append(best)
        covered |= cases[best]
    target = math.ceil(fraction * len(cases))
    taken = set(chosen)
    rest = [i for i in order if i not in taken]
    chosen += rest[: max(0, target - len(chosen))]
    return sorted(chosen)


def sample_product(
    key: str, fraction: float = DEFAULT_FRACTION, *, where=None, **options: Sequence
) -> list:
    """An in-test loop over a product of options, sampled as a ``grid`` test's cases:
    every combination under ``MEMWISE_TEST_GRID=full``; otherwise a stratified sample
    (every value of every option at least once, then up to ``fraction`` of the product)
    chosen by the run's seed and ``key``. ``where(case)``, when given, keeps only the
    combinations that exist. Returns the chosen combinations as dicts, in the product's
    order. A value is told apart as in :func:`strata` (a string, number, bool or None by
    itself)."""
    names = list(options)
    product = [dict(zip(names, values)) for values in itertools.product(*options.values())]
    product = [case for case in product if where is None or where(case)]
    if mode() == "full":
        return product
    cases = [strata(case, {n: list(options[n]).index(case[n]) for n in names}) for case in product]
    return [product[i] for i in sample(cases, fraction, key)]


def sample_slow(
    names: Sequence[str], key: str, fraction: float = SLOW_FRACTION, *, at_least_one: bool = False
) -> list[int]:
    """Positions of the chosen tests among one file's slow tests (``names``, their node
    ids, in collection order), returned sorted: ``floor(fraction * n)`` of the ``n``, and
    one more with probability ``frac(fraction * n)`` (so ``fraction * n`` on average: a
    file of few slow tests runs one in some runs, not in every run); at least one when
    ``at_least_one`` (a file with no other test, so that every file runs in CI). Both the
    extra one and the order are drawn from the run's seed and ``key`` (the file). Every
    test is as likely to be chosen, with a positive chance in each run, so across runs
    every slow test runs in CI."""
    if not names:
        return []
    rng = random.Random(f"{seed()}:slow:{key}")
    order = list(range(len(names)))
    rng.shuffle(order)
    expected = fraction * len(names)
    count = math.floor(expected) + (rng.random() < expected - math.floor(expected))
    if at_least_one:
        count = max(1, count)
    return sorted(order[:count])
