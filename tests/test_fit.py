"""mw.fit: budgets met (from memory_analysis), values unchanged, plans monotone, errors."""

import functools
import importlib
import re

import _draw
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import memwise as mw
from memwise import knobs
from memwise.measure import compile_measured, compiled_memory, parse_budget

fit_module = importlib.import_module("memwise.fit")  # memwise.fit is also the function


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
    xs = _draw.normal(jax.random.PRNGKey(0), (1024, 64)) / 8
    return w, xs


@pytest.fixture(scope="module")
def unconstrained_peak(data):
    return compiled_memory(three_knobs, *data, grad=True).peak_bytes


@pytest.mark.slow
def test_budgets_met_and_gradients_unchanged(data):
    w, xs = data
    expected = jax.jit(jax.grad(three_knobs))(w, xs)  # compiled (eager: op by op)
    for budget in ("64MiB", "8MiB", "2MiB"):
        fitted = mw.fit(three_knobs, budget=budget)
        # the gradient compiled once: measured, then run
        compiled, memory = compile_measured(fitted, w, xs, grad=True)
        grad = compiled(w, xs)
        # float32 sums of 1,024 terms of ~1: another chunk size changes the order of
        # the additions, hence the last digits, relative to the sums' scale (~1,000; an
        # entry of ~5 is such a sum with cancellation).
        scale = float(np.max(np.abs(expected)))
        np.testing.assert_allclose(grad, expected, rtol=1e-4, atol=1e-6 * scale)
        peak = memory.peak_bytes
        assert peak <= parse_budget(budget)
        assert fitted.plan.peak_bytes == peak
        assert fitted.compilations <= 10  # three knobs plus the whole-function policy


@pytest.mark.slow
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
    "budget, error",
    [
        (0, ValueError),
        (-5, ValueError),
        (1.5, ValueError),
        ("lots", ValueError),
        ("5 parsecs", ValueError),
        (None, TypeError),
        (True, TypeError),
    ],
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


@pytest.mark.slow
def test_scan_checkpoints_auto_meets_budget():
    def loss(w, xs):
        h, _ = mw.scan(
            lambda h, x: (jnp.tanh(h @ w + x), None), jnp.zeros((64, 64)), xs, checkpoints="auto"
        )
        return jnp.sum(h**2)

    w, xs = jnp.eye(64) * 0.5, jnp.ones((400, 64, 64)) * 0.01
    fastest = mw.fit(loss, budget="1GiB").plan_for(w, xs)
    assert fastest.entries[1].value == 400  # every carry stored: no recomputation
    budget = (fastest.peak_bytes + compiled_memory(loss, w, xs, grad=True).peak_bytes) // 2
    fitted = mw.fit(loss, budget=budget)
    compiled, memory = compile_measured(fitted, w, xs, grad=True)  # measured, then run
    np.testing.assert_allclose(compiled(w, xs), jax.jit(jax.grad(loss))(w, xs), rtol=1e-5)
    assert memory.peak_bytes <= budget
    assert 1 < fitted.plan.entries[1].value < 400


def pairwise_loss(w, xs, chunk_size="auto"):
    """One chunk_size='auto' tile knob over an n x n pairwise logsumexp."""
    return jnp.sum(
        mw.pairwise_reduce(
            lambda a, b: jnp.tanh(a @ w @ b), xs, xs, reduce="logsumexp", chunk_size=chunk_size
        )
    )


@pytest.mark.slow
def test_each_argument_signature_has_its_own_compilation_budget():
    # Planning a second shape after a first must neither run past max_compilations nor
    # settle for a slower plan because the first shape spent the compilations.
    w, small, large = jnp.eye(16) * 0.5, jnp.ones((256, 16)), jnp.ones((512, 16))
    # A budget that the small problem meets only with tiles (not in one): a real choice.
    tiled = functools.partial(pairwise_loss, chunk_size=(128, 128))
    budget = int(1.02 * compiled_memory(tiled, w, large, grad=True).peak_bytes)
    max_compilations = 5

    def fresh():  # a new function: no compiled plans shared with other fits
        return mw.fit(
            lambda w, xs: pairwise_loss(w, xs), budget=budget, max_compilations=max_compilations
        )

    alone = fresh()
    small_alone = alone.plan_for(w, small)
    alone_compilations = alone.compilations

    fitted = fresh()
    fitted.plan_for(w, large)
    first_compilations = fitted.compilations
    small_second = fitted.plan_for(w, small)
    second_compilations = fitted.compilations - first_compilations

    tile = small_alone.entries[-1]
    assert tile.kind == "chunk_size" and 0 < tile.index < tile.n_candidates - 1  # a real choice
    assert first_compilations <= max_compilations
    assert second_compilations == alone_compilations <= max_compilations
    assert small_second.values == small_alone.values
    assert small_second.cost == small_alone.cost
    assert small_second.peak_bytes == small_alone.peak_bytes <= budget
    assert small_second.compilations == second_compilations
    assert fitted.compilations == first_compilations + second_compilations
    assert fitted.plan is small_second  # the most recent signature's plan
    np.testing.assert_allclose(
        jax.grad(fitted)(w, small), jax.grad(pairwise_loss)(w, small), rtol=1e-5
    )


def scan_loss(w, xs):
    """One checkpoints='auto' knob over a scan of len(xs) steps."""
    h, _ = mw.scan(
        lambda h, x: (jnp.tanh(h @ w + x), None), jnp.zeros(xs.shape[1]), xs, checkpoints="auto"
    )
    return jnp.sum(h**2)


@pytest.mark.parametrize("wrap", [jax.jit, jax.checkpoint], ids=["jit", "checkpoint"])
@pytest.mark.parametrize(
    "term, kind",
    [(pairwise_loss, "chunk_size"), (scan_loss, "checkpoints")],
    ids=["pairwise", "scan"],
)
@pytest.mark.slow
def test_auto_knob_inside_a_jitted_or_checkpointed_helper(wrap, term, kind):
    # JAX traces such a helper once and caches it; fit must still plan and apply its knob.
    helper = wrap(term)

    def loss(w, xs):
        return helper(w, xs)

    w, xs = jnp.eye(16) * 0.5, jnp.ones((256, 16)) * 0.1
    expected = jax.grad(loss)(w, xs)  # the helper is now cached with the default knob
    fastest = mw.fit(loss, budget="1GiB", policies=False).plan_for(w, xs)
    assert [(e.kind, e.index) for e in fastest.entries] == [(kind, 0)]
    fitted = mw.fit(loss, budget=fastest.peak_bytes - 1, policies=False, max_compilations=4)
    for _ in range(2):  # the second call reuses the helper's trace under this plan
        np.testing.assert_allclose(jax.grad(fitted)(w, xs), expected, rtol=1e-4, atol=1e-6)
    entry = fitted.plan.entries[0]
    assert entry.kind == kind and entry.index > 0 and __file__ in entry.source
    assert compiled_memory(fitted, w, xs, grad=True).peak_bytes == fitted.plan.peak_bytes
    assert fitted.plan.peak_bytes < fastest.peak_bytes


@pytest.mark.slow
def test_two_plans_of_one_jitted_helper_stay_apart():
    helper = jax.jit(pairwise_loss)

    def loss(w, xs):
        return helper(w, xs)

    w, xs = jnp.eye(16) * 0.5, jnp.ones((256, 16)) * 0.1
    roomy = mw.fit(loss, budget="1GiB", policies=False)
    tight = mw.fit(
        loss, budget=roomy.plan_for(w, xs).peak_bytes - 1, policies=False, max_compilations=4
    )
    assert tight.plan_for(w, xs).values != roomy.plan_for(w, xs).values
    for fitted in (roomy, tight, roomy, tight):
        assert compiled_memory(fitted, w, xs, grad=True).peak_bytes == fitted.plan.peak_bytes


def test_a_call_reaching_other_knobs_than_planned_is_an_error():
    lines = {"first": True}

    def loss(w, xs):
        if lines["first"]:
            return pairwise_loss(w, xs)
        return scan_loss(w, xs)

    w, xs = jnp.eye(16) * 0.5, jnp.ones((64, 16)) * 0.1
    fitted = mw.fit(loss, budget="1GiB", policies=False)
    fitted(w, xs)
    lines["first"] = False
    with pytest.raises(RuntimeError, match="did not reach the knobs it was planned with"):
        fitted(w, xs)


def static_loss(w, xs, n_layers, *, mode="sum", act=jnp.tanh):
    """A Python int used in range, a string option and a function: static arguments."""
    h = mw.chunked_map(lambda x: act(x @ w), xs, chunk_size="auto")
    for _ in range(n_layers):
        h = act(h @ w)
    return jnp.sum(h) if mode == "sum" else jnp.mean(h)


def test_static_arguments():
    w, xs = jnp.eye(16) * 0.5, jnp.ones((128, 16)) * 0.1
    fitted = mw.fit(static_loss, budget="1GiB", static_argnums=2, static_argnames=("mode", "act"))
    grad = jax.jit(jax.grad(fitted), static_argnums=2, static_argnames=("mode", "act"))
    for n_layers, mode in ((2, "sum"), (3, "mean")):
        np.testing.assert_allclose(
            grad(w, xs, n_layers, mode=mode, act=jnp.sin),
            jax.grad(static_loss)(w, xs, n_layers, mode=mode, act=jnp.sin),
            rtol=1e-5,
        )
    assert len(fitted._signatures) == 2  # each static value is planned on its own
    assert (
        fitted.report_for(w, xs, 3, mode="mean", act=jnp.sin).peak_bytes == fitted.plan.peak_bytes
    )


W, XS = jnp.eye(16), jnp.ones((8, 16))


@pytest.mark.parametrize(
    "make, args, error, match",
    [
        (
            lambda: mw.fit(static_loss, budget="1GiB", static_argnums=(0, 2)),
            None,
            ValueError,
            r"argnums=0 names static",
        ),
        (
            lambda: mw.fit(static_loss, budget="1GiB", static_argnums=7),
            None,
            ValueError,
            "static_argnums=7 is out of range",
        ),
        (
            lambda: mw.fit(static_loss, budget="1GiB", static_argnames="nope"),
            None,
            ValueError,
            "static_argnames='nope' names no parameter",
        ),
        (
            lambda: mw.fit(static_loss, budget="1GiB", static_argnums="2"),
            None,
            TypeError,
            "static_argnums must be an int",
        ),
        (
            lambda: mw.fit(static_loss, budget="1GiB"),
            (W, XS, 3),
            TypeError,
            r"argument 'n_layers' as a Python value.*static_argnums=\(2,\)",
        ),
        (
            lambda: mw.fit(static_loss, budget="1GiB", static_argnums=2),
            (W, XS, [3]),
            TypeError,
            "static arguments must be hashable",
        ),
        (
            lambda: mw.fit(lambda w, xs, mode: pairwise_loss(w, xs), budget="1GiB"),
            (W, XS, "x"),
            TypeError,
            r"argument 2 \('mode'\) is a str.*static_argnums=\(2,\)",
        ),
        (lambda: mw.fit(pairwise_loss, budget="1GiB", argnums="w"), None, TypeError, "argnums"),
        (lambda: mw.fit(pairwise_loss, budget="1GiB", argnums=()), None, TypeError, "argnums"),
        (
            lambda: mw.fit(pairwise_loss, budget="1GiB", argnums=2),
            (W, XS),
            ValueError,
            r"argnums=2 is out of range",
        ),
        (
            lambda: mw.fit(lambda p, xs: jnp.sum(xs), budget="1GiB"),
            (None, XS),
            ValueError,
            r"argnums=0 names argument 0 \('p'\), which holds no arrays",
        ),
        (lambda: mw.fit(pairwise_loss, budget="1GiB", grad="yes"), None, TypeError, "grad must"),
        (
            lambda: mw.fit(pairwise_loss, budget="1GiB", policies=None),
            None,
            TypeError,
            "policies must",
        ),
        (
            lambda: mw.fit(pairwise_loss, budget="1GiB", max_compilations=True),
            None,
            ValueError,
            "max_compilations",
        ),
        (
            lambda: mw.fit(lambda w, xs: pairwise_loss(w, xs) * 1j, budget="1GiB"),
            (W, XS),
            TypeError,
            "grad=True needs a real float output",
        ),
        (
            lambda: mw.fit(lambda w, xs: (pairwise_loss(w, xs), None), budget="1GiB"),
            (W, XS),
            TypeError,
            "one scalar array",
        ),
    ],
)
def test_bad_input_table(make, args, error, match):
    # Each bad input is a TypeError/ValueError naming the argument, raised before anything
    # is compiled (plan_for runs the checks on the first argument signature).
    with pytest.raises(error, match=match):
        make() if args is None else make().plan_for(*args)


def test_none_leaves_are_not_arrays():
    fitted = mw.fit(lambda p, xs: pairwise_loss(p["w"], xs), budget="1GiB")
    grads = jax.grad(fitted)({"w": W, "unused": None}, XS)
    assert grads["unused"] is None and grads["w"].shape == W.shape


def _pair_loss(x, y):
    return jnp.sum(
        mw.pairwise_reduce(
            lambda a, b: -jnp.sum((a - b) ** 2), x, y, reduce="logsumexp", chunk_size="auto"
        )
    )


@pytest.mark.slow
def test_verbose_prints_each_compiled_plan(capsys):
    x = jnp.ones((600, 2))
    fitted = mw.fit(_pair_loss, budget="1MiB", verbose=True, policies=False)
    plan = fitted.plan_for(x, x)
    lines = [line for line in capsys.readouterr().out.splitlines() if "compiled plan" in line]
    assert len(lines) == plan.compilations >= 2
    assert re.search(
        r"chunk_size=\(\d+, \d+\) -> peak .* vs budget 1\.0 MiB \((fits|over)\), "
        r"predicted time \d+\.\d\dx",
        lines[0],
    ), lines[0]


@pytest.mark.slow
def test_tune_searches_the_chosen_plans_neighbours_by_measurement():
    x = _draw.normal(jax.random.PRNGKey(1), (600, 2))
    fitted = mw.fit(_pair_loss, budget="1MiB", tune=True, policies=False)
    plan = fitted.plan_for(x, x)
    tiles = fitted._latest().layout[0].candidates
    timed = [tiles.index(values[0]) for values, _ in plan.timed]
    assert 2 <= len(timed) <= 6 and plan.tuning_compilations <= 6 + 2  # + neighbours over
    assert plan.timing_runs % 6 == 0  # a warm-up and 5 timed runs per plan and round
    # it timed the kept plan and a neighbour on each side it has (one candidate away) that
    # fits, or stopped at 6 plans
    kept = tiles.index(plan.values[0])
    trials = fitted._latest().trials
    fitting = {i for i in (kept - 1, kept + 1) if (i,) in trials and trials[(i,)].fits}
    assert kept in timed and (fitting <= set(timed) or len(timed) == 6)
    seconds = [s for _, s in plan.timed]
    assert seconds == sorted(seconds)
    assert plan.compilations <= 10 and plan.peak_bytes <= parse_budget("1MiB")
    assert "tuned: timed" in plan.to_text()
    assert compiled_memory(fitted, x, x, grad=True).peak_bytes <= parse_budget("1MiB")
    np.testing.assert_allclose(
        jax.grad(fitted)(x, x), jax.grad(_pair_loss)(x, x), rtol=1e-4, atol=1e-4
    )
    # a budget the largest tile meets still times its neighbour: prediction can err
    roomy = mw.fit(_pair_loss, budget="1GiB", tune=True, policies=False).plan_for(x, x)
    assert len(roomy.timed) >= 2 and roomy.compilations <= 1  # the first plan fits


def test_tune_and_verbose_must_be_booleans():
    with pytest.raises(TypeError, match="tune must be True or False"):
        mw.fit(_pair_loss, budget="1MiB", tune="yes")
    with pytest.raises(TypeError, match="verbose must be True or False"):
        mw.fit(_pair_loss, budget="1MiB", verbose=1)


def test_a_leanest_plan_a_little_larger_than_the_next_does_not_hide_a_plan_that_fits():
    # Peaks by candidate: 4000, 2000, 1000 float32 items, then 1100 for the leanest (a
    # tiny tile's bookkeeping can hold a little more than the next tile).
    sizes = (4000, 2000, 1000, 1100)

    def fn(x):
        size = knobs.auto(
            "chunk_size", candidates=sizes, cost=(1.0, 1.1, 1.2, 1.3), default=sizes[0]
        )
        return jnp.sin(x * jnp.arange(size, dtype=jnp.float32))  # an output of `size`

    x = jnp.float32(1.0)
    peaks = {}
    for i, size in enumerate(sizes):
        with knobs.recording() as layout:
            jax.eval_shape(fn, x)
        with knobs.recording([i], layout):
            peaks[size] = compiled_memory(fn, x).peak_bytes
    assert peaks[1000] < peaks[1100] < peaks[2000]
    budget = peaks[1000]  # only the 1000-item plan fits
    fitted = mw.fit(fn, budget=budget, grad=False, policies=False)
    plan = fitted.plan_for(x)
    assert plan.values == (1000,) and plan.peak_bytes <= budget
    np.testing.assert_allclose(fitted(x), jnp.sin(jnp.arange(1000.0)), rtol=1e-6)
    # rising peaks still end the search: below every plan, no plan fits
    with pytest.raises(mw.MemoryBudgetError):
        mw.fit(fn, budget=peaks[1000] - 1, grad=False, policies=False).plan_for(x)


@pytest.mark.slow
def test_a_tuned_fit_composes_with_jit_and_grad():
    # Tuning runs programs: under jax.jit (and jax.grad) it runs them outside the trace,
    # on random arrays of the traced arguments' shapes, then returns the planned program.
    x = _draw.normal(jax.random.PRNGKey(2), (300, 2))
    value = mw.fit(_pair_loss, budget="1MiB", tune=True, grad=False, policies=False)
    np.testing.assert_allclose(jax.jit(value)(x, x), _pair_loss(x, x), rtol=1e-5)
    assert value.plan.timed
    grad = mw.fit(_pair_loss, budget="1MiB", tune=True, policies=False)
    np.testing.assert_allclose(
        jax.jit(jax.grad(grad))(x, x), jax.grad(_pair_loss)(x, x), rtol=1e-4, atol=1e-4
    )
    assert grad.plan.timed


@pytest.mark.slow
def test_a_training_step_planned_without_grad_has_no_whole_function_policy():
    import optax  # a test extra

    optimizer = optax.sgd(0.1)

    @mw.region("block")
    def block(w, x):
        return jnp.tanh(x @ w)

    def loss(w, xs):
        return mw.chunked_sum(lambda x: jnp.sum(block(w, x) ** 2), xs, chunk_size="auto")

    def train_step(w, opt_state, xs):
        grads = jax.grad(loss)(w, xs)
        updates, opt_state = optimizer.update(grads, opt_state, w)
        return optax.apply_updates(w, updates), opt_state

    w, xs = jnp.eye(8) / 2, jnp.ones((64, 8))
    step = mw.fit(train_step, budget="1MiB", grad=False)
    new_w, _ = jax.jit(step)(w, optimizer.init(w), xs)
    labels = [entry.label for entry in step.plan.entries]
    # a policy for the step as a whole cannot change a program nothing differentiates;
    # the region inside the differentiated loss is still a knob
    assert not any(label.startswith("whole") for label in labels), labels
    assert "region 'block'" in labels
    expected, _ = train_step(w, optimizer.init(w), xs)
    np.testing.assert_allclose(new_w, expected, rtol=1e-6)
