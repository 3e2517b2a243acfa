"""mw.fit: budgets met (from memory_analysis), values unchanged, plans monotone, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import memwise as mw
from memwise.fit import device_memory_bytes, parse_budget
from memwise.measure import compiled_memory


def three_knobs(w, xs):
    """Three chunk_size='auto' knobs; each item makes a (d, d) intermediate."""

    def term(x):
        h = jnp.tanh(x[:, None] * w[None, :])
        return jnp.sum(h @ h)

    a = mw.chunked_sum(term, xs, chunk_size="auto")
    b = mw.chunked_sum(lambda x: jnp.sum(jnp.sin(jnp.outer(x, w))), xs, chunk_size="auto")
    c = mw.chunked_map(lambda x: jnp.cos(jnp.outer(x, w)).sum(), xs, chunk_size="auto")
    return a + b + jnp.sum(c)


@pytest.fixture(scope="module")
def data():
    w = jnp.linspace(0.0, 1.0, 64)
    xs = jax.random.normal(jax.random.PRNGKey(0), (1024, 64)) / 8
    return w, xs


@pytest.fixture(scope="module")
def unconstrained_peak(data):
    return compiled_memory(three_knobs, *data, grad=True).peak_bytes


def test_budgets_met_and_gradients_unchanged(data):
    w, xs = data
    expected = jax.grad(three_knobs)(w, xs)
    for budget in ("64MiB", "8MiB", "2MiB"):
        fitted = mw.fit(three_knobs, budget=budget)
        grad = jax.grad(fitted)(w, xs)
        np.testing.assert_allclose(grad, expected, rtol=2e-5, atol=1e-4)
        peak = compiled_memory(fitted, w, xs, grad=True).peak_bytes
        assert peak <= parse_budget(budget)
        assert fitted.plan.peak_bytes == peak
        assert fitted.compilations <= 10  # three knobs plus the whole-function policy


def test_value_is_exactly_fn(data):
    fitted = mw.fit(three_knobs, budget="4MiB", grad=False)
    np.testing.assert_allclose(fitted(*data), three_knobs(*data), rtol=1e-5)


def test_plan_monotone_in_budget(data):
    costs = []
    for budget in ("2MiB", "3MiB", "6MiB", "24MiB", "1GiB"):
        costs.append(mw.fit(three_knobs, budget=budget).plan_for(*data).cost)
    assert costs == sorted(costs, reverse=True), costs


def test_generous_budget_takes_fastest_plan_in_one_compilation(data):
    fitted = mw.fit(lambda w, xs: three_knobs(w, xs), budget="16GiB")
    plan = fitted.plan_for(*data)
    assert plan.cost == 1.0
    assert all(entry.index == 0 for entry in plan.entries)
    assert fitted.compilations == 1


def test_plan_frontier_and_report(data):
    fitted = mw.fit(three_knobs, budget="3MiB")
    jax.grad(fitted)(*data)
    kinds = [e.kind for e in fitted.plan.entries]
    assert kinds == ["policy", "chunk_size", "chunk_size", "chunk_size"]
    assert all("test_fit.py" in e.source for e in fitted.plan.entries)
    text = fitted.plan.to_text()
    assert "chunk_size" in text and "budget 3.0 MiB" in text
    assert any(t.fits for t in fitted.frontier) and fitted.compilations <= 10
    costs = [t.cost for t in fitted.frontier]
    assert costs == sorted(costs)
    assert fitted.report.peak_bytes == fitted.plan.peak_bytes


def test_impossible_budget_says_what_dominates(data):
    with pytest.raises(mw.MemoryBudgetError, match=r"smallest peak reached is .*dominated by"):
        mw.fit(three_knobs, budget="64KiB").plan_for(*data)


def test_region_policy_is_a_knob():
    @mw.region("block")
    def block(h, w):
        for _ in range(4):
            h = jnp.tanh(h @ w)
        return h

    def loss(w, x):
        return jnp.sum(block(block(x, w), w) ** 2)

    w, x = jnp.eye(32) * 0.5, jnp.ones((256, 32))
    fitted = mw.fit(loss, budget="1GiB")
    np.testing.assert_allclose(jax.grad(fitted)(w, x), jax.grad(loss)(w, x), rtol=1e-5)
    labels = [e.label for e in fitted.plan.entries]
    assert labels == ["whole loss", "region 'block'", "region 'block'"]
    assert block(x, w).shape == x.shape  # outside fit the region runs unchanged


@pytest.mark.parametrize(
    "budget, expected",
    [(1024, 1024), ("8GiB", 8 * 2**30), ("512MB", 512 * 10**6), ("1.5 KiB", 1536), ("2gb", 2 * 10**9)],
)
def test_parse_budget(budget, expected):
    assert parse_budget(budget) == expected


def test_parse_budget_fraction_of_device():
    assert 0 < parse_budget(0.5) <= device_memory_bytes()


@pytest.mark.parametrize(
    "budget, error",
    [(0, ValueError), (-5, ValueError), (1.5, ValueError), ("lots", ValueError),
     ("5 parsecs", ValueError), (None, TypeError), (True, TypeError)],
)
def test_bad_budgets(budget, error):
    with pytest.raises(error, match="budget"):
        mw.fit(jnp.sum, budget=budget)


def test_bad_arguments():
    with pytest.raises(TypeError, match="fn must be callable"):
        mw.fit(3, budget="1GiB")
    with pytest.raises(TypeError, match="region"):
        mw.region("r")(5)
    with pytest.raises(TypeError, match="non-empty string"):
        mw.region("")


def test_scan_checkpoints_auto_meets_budget():
    def loss(w, xs):
        h, _ = mw.scan(lambda h, x: (jnp.tanh(h @ w + x), None), jnp.zeros((64, 64)), xs,
                       checkpoints="auto")
        return jnp.sum(h**2)

    w, xs = jnp.eye(64) * 0.5, jnp.ones((400, 64, 64)) * 0.01
    fastest = mw.fit(loss, budget="1GiB").plan_for(w, xs)
    assert fastest.entries[1].value == 400  # every carry stored: no recomputation
    budget = (fastest.peak_bytes + compiled_memory(loss, w, xs, grad=True).peak_bytes) // 2
    fitted = mw.fit(loss, budget=budget)
    np.testing.assert_allclose(jax.grad(fitted)(w, xs), jax.grad(loss)(w, xs), rtol=1e-5)
    assert compiled_memory(fitted, w, xs, grad=True).peak_bytes <= budget
    assert 1 < fitted.plan.entries[1].value < 400
