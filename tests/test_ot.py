"""Tests of memwise.ot against OTT-JAX's dense solver, a dense JAX reference, and XLA."""

from __future__ import annotations

import functools
import inspect
import textwrap

import _draw
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _multidevice import run_on_devices
from ott.geometry import costs as ott_costs  # noqa: E402
from ott.geometry import pointcloud  # noqa: E402
from ott.problems.linear import linear_problem  # noqa: E402
from ott.solvers.linear import implicit_differentiation as ott_implicit  # noqa: E402
from ott.solvers.linear import sinkhorn as ott_sinkhorn  # noqa: E402
from ott.tools import sinkhorn_divergence as ott_divergence  # noqa: E402

import memwise as mw
from memwise import ot
from memwise.measure import compile_measured, compiled_memory

TIGHT = dict(threshold=1e-6, max_iterations=5000)
OTT_COSTS = {
    "sqeuclidean": ott_costs.SqEuclidean(),
    "euclidean": ott_costs.Euclidean(),
    "cosine": ott_costs.Cosine(),
}


def clouds(seed, n=100, m=80, d=2, zeros=0):
    k = jax.random.split(jax.random.key(seed), 4)
    x = _draw.normal(k[0], (n, d))
    y = 0.7 * _draw.normal(k[1], (m, d)) + 1.0
    a = _draw.uniform(k[2], (n,), minval=0.2)
    b = _draw.uniform(k[3], (m,), minval=0.2).at[:zeros].set(0.0)
    return x, y, a / a.sum(), b / b.sum()


def ott_reg_cost(x, y, a, b, eps, cost):
    geom = pointcloud.PointCloud(x, y, epsilon=eps, cost_fn=OTT_COSTS[cost])
    solver = ott_sinkhorn.Sinkhorn(use_danskin=True, **TIGHT)
    return solver(linear_problem.LinearProblem(geom, a, b))


def rel(u, v):
    return float(jnp.linalg.norm(u - v) / jnp.linalg.norm(v))


@pytest.mark.parametrize(
    "seed,eps,cost,zeros",
    [
        (1, 0.5, "sqeuclidean", 17),
        (2, 0.05, "euclidean", 0),
        pytest.param(3, 0.02, "cosine", 5, marks=pytest.mark.slow),
    ],
)
@pytest.mark.slow
def test_sinkhorn_matches_ott_dense(seed, eps, cost, zeros):
    x, y, a, b = clouds(seed, zeros=zeros, d=3 if cost == "cosine" else 2)
    kw = dict(epsilon=eps, cost=cost, chunk_size=(48, 40), **TIGHT)

    def ours(x, y, a, b):
        out = ot.sinkhorn(x, y, a, b, **kw)
        return out.reg_ot_cost, out

    def theirs(x, y, a, b):
        out = ott_reg_cost(x, y, a, b, eps, cost)
        return out.reg_ot_cost, (out.f, out.converged, out.n_iters)

    (_, out), (gx, gy, ga, gb) = jax.jit(jax.value_and_grad(ours, (0, 1, 2, 3), has_aux=True))(
        x, y, a, b
    )
    (ref_cost, (ref_f, ref_converged, ref_iters)), (rx, ry, ra) = jax.jit(
        jax.value_and_grad(theirs, (0, 1, 2), has_aux=True)
    )(x, y, a, b)
    assert bool(out.converged) and bool(ref_converged)
    np.testing.assert_allclose(out.reg_ot_cost, ref_cost, rtol=1e-4)
    # OTT's potentials are ours plus eps log(weights), up to a shared constant.
    f_ott = out.f + eps * jnp.log(a)
    np.testing.assert_allclose(f_ott - f_ott.mean(), ref_f - ref_f.mean(), atol=1e-3)
    assert int(out.n_iterations) <= int(ref_iters) + 1  # we check every iteration
    assert np.all(np.asarray(out.errors[: int(out.n_iterations)]) >= 0)
    assert np.all(np.asarray(out.errors[int(out.n_iterations) :]) == -1)
    assert rel(gx, rx) < 1e-3 and rel(gy, ry) < 1e-3
    # The weight gradient is defined up to a constant (sum(a) == sum(b)): centred.
    assert abs(float(ga.mean())) < 1e-6 and abs(float(gb.mean())) < 1e-6
    assert rel(ga, ra - ra.mean()) < 1e-3
    assert bool(jnp.all(jnp.isfinite(gb)))  # OTT's is NaN at zero weights; ours is not


@pytest.mark.slow
def test_divergence_matches_ott_dense_value_and_gradient():
    x, y, a, b = clouds(4, n=120, m=100)
    kw = dict(epsilon=0.2, chunk_size=64, **TIGHT)
    ours = jax.jit(
        jax.value_and_grad(
            lambda x, y, a, b: ot.sinkhorn_divergence(x, y, a, b, **kw), (0, 1, 2, 3)
        )
    )

    def theirs(x, y, a, b):
        return ott_divergence.sinkhorn_divergence(
            pointcloud.PointCloud,
            x,
            y,
            a=a,
            b=b,
            epsilon=0.2,
            solve_kwargs=dict(use_danskin=True, **TIGHT),
        )[0]

    value, grads = ours(x, y, a, b)
    ref_value, ref_grads = jax.jit(jax.value_and_grad(theirs, (0, 1, 2, 3)))(x, y, a, b)
    np.testing.assert_allclose(value, ref_value, rtol=1e-4)
    for g, r in zip(grads[:2], ref_grads[:2]):
        assert rel(g, r) < 1e-3
    for g, r in zip(grads[2:], ref_grads[2:]):
        assert rel(g, r - r.mean()) < 1e-3


@pytest.mark.slow
def test_potential_gradients_match_ott_implicit_differentiation():
    x, y, a, b = clouds(15, n=30, m=25)
    u, v = _draw.normal(jax.random.key(16), (2, 30))
    v = v[:25] - v[:25].mean() + u.sum() / 25  # sum(u) == sum(v): blind to the gauge

    def ours(x, y):
        out = ot.sinkhorn(x, y, a, b, epsilon=0.3, chunk_size=8, **TIGHT)
        return u @ out.f + v @ out.g

    def theirs(x, y):
        geom = pointcloud.PointCloud(x, y, epsilon=0.3)
        solver = ott_sinkhorn.Sinkhorn(implicit_diff=ott_implicit.ImplicitDiff(), **TIGHT)
        out = solver(linear_problem.LinearProblem(geom, a, b))
        return u @ out.f + v @ out.g

    grads = jax.jit(jax.grad(ours, (0, 1)))(x, y)
    ref_grads = jax.jit(jax.grad(theirs, (0, 1)))(x, y)
    for g, r in zip(grads, ref_grads):
        assert float(jnp.linalg.norm(r)) > 1e-2 and rel(g, r) < 1e-3


@pytest.mark.slow
def test_potential_gradients_match_finite_differences_in_float64():
    with jax.enable_x64(True):
        x, y, a, b = (v.astype("float64") for v in clouds(17, n=12, m=10, zeros=2))
        keys = jax.random.split(jax.random.key(18), 6)
        u, v = _draw.normal(keys[0], (12,)), _draw.normal(keys[1], (10,))
        tight = {"chunk_size": 4, "threshold": 1e-13, "max_iterations": 20_000}

        @jax.jit
        def loss(x, y, a, b, eps):
            out = ot.sinkhorn(x, y, a, b, epsilon=eps, **tight)
            # The returned potentials are in the gauge <a, f> = <b, g>.
            return u @ out.f + v @ out.g, jnp.abs(a @ out.f - b @ out.g)

        @jax.jit
        def self_terms(x):
            _, (_, xx, yy) = ot.sinkhorn_divergence(
                x, y, a, b, epsilon=0.4, **tight, return_results=True
            )
            return u @ xx.f + v @ yy.g

        args = [x, y, a, b, jnp.asarray(0.4)]
        value, gauge = loss(*args)
        assert float(gauge) < 1e-10
        grads = jax.jit(jax.grad(lambda *args: loss(*args)[0], range(5)))(*args)
        on_b = b > 0
        directions = [
            _draw.normal(keys[2], x.shape),
            _draw.normal(keys[3], y.shape),
            _draw.normal(keys[4], a.shape),
            _draw.normal(keys[5], b.shape),
            jnp.asarray(1.0),
        ]
        directions[2] -= directions[2].mean()  # weights move keeping their totals
        directions[3] = jnp.where(on_b, directions[3] - directions[3][on_b].mean(), 0.0)
        for i, (direction, grad) in enumerate(zip(directions, grads)):
            step = [1e-5 * direction if j == i else 0.0 for j in range(5)]
            plus = loss(*(arg + s for arg, s in zip(args, step)))[0]
            minus = loss(*(arg - s for arg, s in zip(args, step)))[0]
            np.testing.assert_allclose(jnp.sum(grad * direction), (plus - minus) / 2e-5, rtol=1e-6)
        # At a zero weight, one-sided: give b_0 = 0 some of b_5's mass.
        move = jnp.zeros(10).at[0].set(1.0).at[5].set(-1.0)
        one_sided = (loss(x, y, a, b + 1e-7 * move, 0.4)[0] - value) / 1e-7
        np.testing.assert_allclose(grads[3] @ move, one_sided, rtol=1e-5)
        # The self terms' potentials (x moves on both sides of OT(a, a)).
        direction = directions[0]
        grad = jax.jit(jax.grad(self_terms))(x)
        fd = (self_terms(x + 1e-5 * direction) - self_terms(x - 1e-5 * direction)) / 2e-5
        np.testing.assert_allclose(jnp.sum(grad * direction), fd, rtol=1e-6)


@pytest.mark.slow
def test_default_epsilon_is_ott_default_and_scaling_agrees():
    x, y, a, b = clouds(5, n=60, m=50)
    out = ot.sinkhorn(x, y, chunk_size=(32, 64), max_iterations=1)
    np.testing.assert_allclose(out.epsilon, pointcloud.PointCloud(x, y).epsilon, rtol=1e-5)
    # Annealing from the diameter reaches the same divergence in fewer iterations.
    run = jax.jit(
        lambda x, y, s: ot.sinkhorn(
            x, y, chunk_size=(32, 64), epsilon=0.02, threshold=1e-4, epsilon_scaling=s
        ),
        static_argnums=2,
    )
    scaled, plain = run(x, y, 0.5), run(x, y, None)
    assert bool(scaled.converged) and bool(plain.converged)
    np.testing.assert_allclose(scaled.reg_ot_cost, plain.reg_ot_cost, rtol=1e-3)
    assert int(scaled.n_iterations) < int(plain.n_iterations)


@pytest.mark.parametrize("n,m,shift", [(5, 7, 0.0), (1, 1, 0.0), (1, 1, 1.0), (1, 4, 0.5)])
@pytest.mark.slow
def test_default_epsilon_is_floored_when_every_cost_is_equal(n, m, shift):
    # One point each or all points in one place: OTT's default epsilon is 0 (cost NaN).
    point = jnp.array([0.3, -1.2])
    x, y = jnp.tile(point, (n, 1)), jnp.tile(point + shift, (m, 1))
    cost = float(jnp.sum((point - (point + shift)) ** 2))

    @jax.jit  # the three in one program (eager, each operation compiled on its own)
    def solve(x, y):
        divergence, grad = jax.value_and_grad(lambda x: ot.sinkhorn_divergence(x, y))(x)
        return ot.sinkhorn(x, y), divergence, grad

    out, divergence, grad = solve(x, y)
    assert float(out.epsilon) > 0 and bool(out.converged)
    np.testing.assert_allclose(out.reg_ot_cost, cost, atol=1e-5)  # any plan costs C
    np.testing.assert_allclose(divergence, cost, atol=1e-5)
    np.testing.assert_allclose(grad.sum(0), 2 * (point - (point + shift)), atol=1e-4)


@jax.jit
def _divergence_value_and_grad(x, y):
    """At module level: the float32 reference is compiled once for every dtype's case."""
    return jax.value_and_grad(
        lambda x: ot.sinkhorn_divergence(x, y, chunk_size=64, threshold=1e-4)
    )(x)


@pytest.mark.parametrize(
    "dtype,rtol", [("float32", 1e-6), ("float64", 1e-4), ("bfloat16", 1e-2), ("float16", 2e-3)]
)
@pytest.mark.slow
def test_divergence_in_each_float_dtype_is_the_float32_result_in_that_dtype(dtype, rtol):
    x, y, _, _ = clouds(14)
    value_and_grad = _divergence_value_and_grad
    with jax.enable_x64(dtype == "float64"):
        low_x, low_y = x.astype(dtype), y.astype(dtype)
        value, grad = value_and_grad(low_x, low_y)
        # The float32 reference sees the same (rounded) points.
        ref_value, ref_grad = value_and_grad(low_x.astype("float32"), low_y.astype("float32"))
    assert value.dtype == dtype and grad.dtype == dtype
    np.testing.assert_allclose(float(value), float(ref_value), rtol=rtol)
    assert rel(grad.astype("float32"), ref_grad) < max(rtol, 1e-4)


def dense_reg_cost(cost, x, y, a, b, eps, iterations=3000):
    """Naive JAX reference: dense log-domain Sinkhorn, envelope gradient by autodiff."""
    c = jax.vmap(jax.vmap(cost, (None, 0)), (0, None))(x, y)
    c0 = jax.lax.stop_gradient(c)

    def step(g, _):
        f = -eps * jax.nn.logsumexp(jnp.log(b) + (g - c0) / eps, axis=1)
        return -eps * jax.nn.logsumexp(jnp.log(a)[:, None] + (f[:, None] - c0) / eps, axis=0), f

    g, fs = jax.lax.scan(step, jnp.zeros_like(b), None, length=iterations)
    f = -eps * jax.nn.logsumexp(jnp.log(b) + (g - c0) / eps, axis=1)
    f, g = jax.lax.stop_gradient((f, g))
    plan = a[:, None] * b[None] * jnp.exp((f[:, None] + g[None] - c) / eps)
    return a @ f + b @ g + eps * (a.sum() * b.sum() - plan.sum())


@pytest.mark.slow
def test_callable_cost_gradient_reaches_closed_over_parameters():
    x, y, a, b = clouds(6, n=90, m=70)
    metric = jnp.array([[2.0, 0.3], [0.3, 0.5]])

    def loss(metric, x, impl):
        cost = lambda u, v: (u - v) @ metric @ (u - v)  # noqa: E731
        if impl == "dense":
            return dense_reg_cost(cost, x, y, a, b, 0.3)
        return ot.sinkhorn(x, y, a, b, epsilon=0.3, cost=cost, chunk_size=32, **TIGHT).reg_ot_cost

    ours = jax.jit(jax.value_and_grad(lambda m, x: loss(m, x, "memwise"), (0, 1)))
    ref = jax.jit(jax.value_and_grad(lambda m, x: loss(m, x, "dense"), (0, 1)))
    (v, (gm, gx)), (rv, (rm, rx)) = ours(metric, x), ref(metric, x)
    np.testing.assert_allclose(v, rv, rtol=1e-4)
    assert rel(gm, rm) < 1e-3 and rel(gx, rx) < 1e-3


@pytest.mark.slow
def test_a_cost_closing_over_a_wider_dtype_is_solved_in_the_points_dtype():
    # float32 points, a cost closing over a float64 metric: the cost's value is cast to
    # the problem's dtype (the solver's loop carry once failed on the mismatch); the
    # metric's gradient comes back in its own dtype.
    with jax.enable_x64(True):
        x, y, a, b = (v.astype(jnp.float32) for v in clouds(8, n=40, m=30))
        metric = jnp.array([[2.0, 0.3], [0.3, 0.5]], jnp.float64)

        def loss(metric, x):
            cost = lambda u, v: (u - v) @ metric @ (u - v)  # noqa: E731
            return ot.sinkhorn(x, y, a, b, epsilon=0.3, cost=cost, chunk_size=16).reg_ot_cost

        value, grad = jax.jit(jax.value_and_grad(loss))(metric, x)
        assert value.dtype == jnp.float32 and grad.dtype == jnp.float64
        wide = jax.tree.map(lambda v: v.astype(jnp.float64), (x, y, a, b))
        cost64 = lambda u, v: (u - v) @ metric @ (u - v)  # noqa: E731
        expected = jax.jit(
            lambda *wide: ot.sinkhorn(*wide, epsilon=0.3, cost=cost64, chunk_size=16).reg_ot_cost
        )(*wide)
        np.testing.assert_allclose(value, expected, rtol=1e-5)


@pytest.mark.slow
def test_convergence_flags_and_iteration_cap():
    x, y, a, b = clouds(7)
    out = jax.jit(lambda x, y: ot.sinkhorn(x, y, epsilon=0.01, max_iterations=4, chunk_size=64))(
        x, y
    )
    assert not bool(out.converged)
    assert int(out.n_iterations) == 4
    errors = np.asarray(out.errors)
    assert errors.shape == (4,) and np.all(errors > 1e-3)
    done = jax.jit(lambda x, y: ot.sinkhorn(x, y, epsilon=1.0, chunk_size=64))(x, y)
    assert bool(done.converged)
    n_it = int(done.n_iterations)
    assert done.errors[n_it - 1] < 1e-3 and np.all(np.asarray(done.errors[n_it:]) == -1)


def test_public_functions_take_the_problem_arguments_by_prepare_names():
    # sinkhorn and sinkhorn_divergence hand their arguments to prepare by its parameter
    # names (memwise.ot.api._problem): each must take every one, with prepare's default.
    from memwise.ot.problem import prepare

    for fn in (ot.sinkhorn, ot.sinkhorn_divergence):
        public = inspect.signature(fn).parameters
        for name, parameter in inspect.signature(prepare).parameters.items():
            assert name in public, (fn.__name__, name)
            if parameter.default is not parameter.empty:
                assert public[name].default == parameter.default, (fn.__name__, name)


def test_bad_input_raises_clear_errors():
    x, y, a, b = clouds(8, n=20, m=30)
    with pytest.raises(ValueError, match="same dimension"):
        ot.sinkhorn(x, jnp.ones((30, 3)), epsilon=0.1)
    with pytest.raises(ValueError, match="negative"):
        ot.sinkhorn(x, y, a.at[0].set(-0.1), b, epsilon=0.1)
    with pytest.raises(ValueError, match="all zeros"):
        ot.sinkhorn(x, y, a, jnp.zeros_like(b), epsilon=0.1)
    with pytest.raises(ValueError, match="NaN"):
        ot.sinkhorn(x.at[3, 0].set(jnp.nan), y, epsilon=0.1)
    with pytest.raises(ValueError, match="epsilon"):
        ot.sinkhorn_divergence(x, y, epsilon=0.0)
    with pytest.raises(ValueError, match="shape"):
        ot.sinkhorn(x, y, a[:5], b, epsilon=0.1)
    with pytest.raises(ValueError, match="cost"):
        ot.sinkhorn(x, y, epsilon=0.1, cost="manhattan")
    with pytest.raises(ValueError, match="epsilon_scaling"):
        ot.sinkhorn(x, y, epsilon=0.1, epsilon_scaling=2.0)
    with pytest.raises(ValueError, match="chunk_size"):
        ot.sinkhorn(x, y, epsilon=0.1, chunk_size=0)
    with pytest.raises(TypeError, match="floats"):
        ot.sinkhorn(jnp.ones((4, 2), jnp.int32), y, epsilon=0.1)


def test_non_real_options_name_the_argument():
    # A string or complex number is a NumPy scalar, but not a positive float.
    x, y, _, _ = clouds(8, n=20, m=30)
    with pytest.raises(ValueError, match="threshold must be a positive float"):
        ot.sinkhorn(x, y, epsilon=0.1, threshold="1e-3")
    with pytest.raises(ValueError, match="epsilon_scaling"):
        ot.sinkhorn_divergence(x, y, epsilon=0.1, epsilon_scaling=0.5j)


@pytest.mark.slow
def test_bad_values_under_jit_report_not_converged_not_silent_nan():
    x, y, a, b = clouds(9, n=20, m=30)

    @jax.jit
    def run(x, eps):
        out = ot.sinkhorn(x, y, epsilon=eps, chunk_size=8)
        return out, jax.grad(lambda x: ot.sinkhorn(x, y, epsilon=eps, chunk_size=8).reg_ot_cost)(x)

    for bad_x, eps in ((x.at[2, 1].set(jnp.nan), 0.1), (x, -0.1), (x, jnp.nan)):
        out, grad = run(bad_x, eps)
        assert not bool(out.converged)
        assert np.isnan(np.asarray(out.errors[int(out.n_iterations) - 1]))
        assert int(out.n_iterations) == 1  # stopped at the first NaN
    # A cost that is infinite for a whole row cannot transport: not converged.
    inf_cost = lambda u, v: jnp.where(u[0] > 1.5, jnp.inf, jnp.sum((u - v) ** 2))  # noqa
    out = ot.sinkhorn(x.at[0, 0].set(2.0), y, epsilon=0.1, cost=inf_cost, chunk_size=8)
    assert not bool(out.converged)


def test_unequal_weight_totals_raise_or_give_nan_under_jit():
    x, y, a, b = clouds(13, n=20, m=30)
    for solve in (ot.sinkhorn, ot.sinkhorn_divergence):
        with pytest.raises(ValueError, match=r"sum\(a\) = 1 and sum\(b\) = 3"):
            solve(x, y, a, 3 * b, epsilon=0.1)
    run = jax.jit(
        lambda a, b: ot.sinkhorn_divergence(
            x, y, a, b, epsilon=0.1, chunk_size=8, return_results=True
        )
    )
    divergence, (xy, _, _) = run(a, 3 * b)
    assert np.isnan(divergence) and np.isnan(xy.reg_ot_cost) and not bool(xy.converged)
    # A mismatch at the weights' rounding level is balanced (b takes a's total).
    reference, (xy, _, _) = run(a, b)
    rounded, (xy_rounded, _, _) = run(a, b * (1 + 3e-6))
    assert bool(xy.converged) and bool(xy_rounded.converged)
    np.testing.assert_allclose(rounded, reference, rtol=1e-4)


FORWARD_MODE = {
    "jvp": lambda fn, x: jax.jvp(fn, (x,), (jnp.ones_like(x),)),
    "jacfwd": lambda fn, x: jax.jacfwd(fn)(x),
    "hessian": lambda fn, x: jax.hessian(fn)(x),
    "linearize": lambda fn, x: jax.linearize(fn, x)[1](jnp.ones_like(x)),
    "grad_of_grad": lambda fn, x: jax.grad(lambda x: jnp.sum(jax.grad(fn)(x) ** 2))(x),
}


def _transformed(transform, jit, loss):
    apply = FORWARD_MODE[transform]
    if jit == "jit_inside":
        return lambda x: apply(jax.jit(loss), x)
    if jit == "jit_outside":
        return jax.jit(lambda x: apply(loss, x))
    return lambda x: apply(loss, x)


@pytest.mark.grid
@pytest.mark.parametrize("jit", ["eager", "jit_outside", "jit_inside"])
@pytest.mark.parametrize("transform", sorted(FORWARD_MODE))
@pytest.mark.slow
def test_forward_mode_and_second_order_raise_memwise_type_error(transform, jit):
    x, y, _, _ = clouds(10, n=16, m=12)
    losses = (
        lambda x: ot.sinkhorn_divergence(x, y, epsilon=0.3, chunk_size=8),
        lambda x: ot.sinkhorn(x, y, epsilon=0.3, chunk_size=8).reg_ot_cost,
        lambda x: ot.sinkhorn(x, y, epsilon=0.3, chunk_size=8).f[0],
    )
    for loss in losses:
        with pytest.raises(TypeError, match="first-order reverse mode only"):
            _transformed(transform, jit, loss)(x)


@pytest.mark.slow
def test_reverse_mode_composes_with_vmap_and_jit():
    x, y, _, _ = clouds(12, n=16, m=12)
    xs = jnp.stack([x, x + 0.3])
    loss = lambda x: ot.sinkhorn_divergence(x, y, epsilon=0.3, chunk_size=8)  # noqa: E731
    # the reference: one problem at a time, compiled once for both (eager, each call
    # compiled its loops again)
    single_grad = jax.jit(jax.grad(loss))
    single = jnp.stack([single_grad(xi) for xi in xs])
    np.testing.assert_allclose(jax.jit(jax.vmap(jax.grad(loss)))(xs), single, atol=1e-5)
    grad_of_vmap = jax.jit(jax.grad(lambda xs: jax.vmap(loss)(xs).sum()))  # compiled
    np.testing.assert_allclose(grad_of_vmap(xs), single, atol=1e-5)
    np.testing.assert_allclose(jax.jacrev(jax.jit(loss))(x), single[0], atol=1e-5)


@pytest.mark.slow
def test_vmap_over_problems():
    x, y, _, _ = clouds(11, n=24, m=20)
    xs = jnp.stack([x, x + 0.5])
    fn = lambda x: ot.sinkhorn(x, y, epsilon=0.2, chunk_size=8).reg_ot_cost  # noqa: E731
    batched = jax.jit(jax.vmap(fn))(xs)
    single_fn = jax.jit(fn)  # the reference, compiled once for both problems
    single = [single_fn(xi) for xi in xs]
    np.testing.assert_allclose(batched, jnp.stack(single), rtol=1e-5)


@pytest.mark.slow
def test_gradient_memory_flat_in_n_and_within_2x_of_forward():
    def temps(n):
        x, y = jnp.zeros((n, 2)), jnp.ones((n, 2))
        fn = lambda x, y: ot.sinkhorn_divergence(x, y, epsilon=0.1)  # noqa: E731
        return compiled_memory(fn, x, y).temp_bytes, compiled_memory(fn, x, y, grad=True).temp_bytes

    fwd_10k, grad_10k = temps(10_000)
    fwd_20k, grad_20k = temps(20_000)
    assert grad_20k <= 2 * fwd_20k
    assert grad_20k < 100 * 2**20  # OTT online: 4,579 MiB
    # 10,000 more points add O(n) vectors; one n x m float32 matrix would add 1.1 GiB.
    assert grad_20k - grad_10k < 200 * 10_000


@pytest.mark.slow
def test_squared_euclidean_gradient_holds_one_scaled_tile_fewer():
    """The built-in squared Euclidean cost puts 1/epsilon and its norms on each point's
    own terms, so the backward of a tile does not hold the score's cotangent scaled for
    the norms as well as for the product: one 256 x 256 float32 tile less than the same
    cost written out, with the same gradient."""
    x, y, _, _ = clouds(5, n=2_048, m=2_048)
    # The same expansion passed as a callable takes the generic score, -cost / eps.
    expanded = ot.costs.BUILTIN_COSTS["sqeuclidean"]

    def loss(cost):
        return lambda x, y: (
            ot.sinkhorn(
                x, y, epsilon=0.5, cost=cost, chunk_size=(256, 256), max_iterations=20
            ).reg_ot_cost
        )

    # each gradient compiled once: measured, then run
    measured = {
        name: compile_measured(fn, x, y, grad=True, argnums=(0, 1))
        for name, fn in (("built-in", loss("sqeuclidean")), ("written", loss(expanded)))
    }
    temp = {name: memory.temp_bytes for name, (_, memory) in measured.items()}
    # The built-in cost also holds the clouds about their middle (x and y, 32 KiB); the
    # other buffers differ by a few KiB either way.
    centred = (x.size + y.size) * 4
    assert temp["written"] - (temp["built-in"] - centred) >= 0.95 * 256 * 256 * 4, temp
    grads = {name: compiled(x, y) for name, (compiled, _) in measured.items()}
    for g, r in zip(grads["built-in"], grads["written"]):
        assert rel(g, r) < 1e-5


_SHARDED = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from memwise import ot
    assert jax.device_count() == 4
    x = jax.random.normal(jax.random.key(0), (256, 2))
    y = jax.random.normal(jax.random.key(1), (192, 2)) + 1.0
    mesh = Mesh(np.array(jax.devices()), ("points",))
    shard = NamedSharding(mesh, P("points", None))
    xs, ys = jax.device_put(x, shard), jax.device_put(y, shard)
    fn = jax.jit(jax.value_and_grad(
        lambda x, y: ot.sinkhorn_divergence(x, y, epsilon=0.1, chunk_size=32,
                                            threshold=1e-5), (0, 1)))
    (v, (gx, gy)) = fn(xs, ys)
    (rv, (rx, ry)) = fn(x, y)
    assert len(xs.sharding.device_set) == 4
    np.testing.assert_allclose(v, rv, rtol=1e-5)
    np.testing.assert_allclose(gx, rx, atol=1e-5)
    np.testing.assert_allclose(gy, ry, atol=1e-5)
    print("OK", float(v))
    """
)


@pytest.mark.slow
def test_sharded_points_on_four_devices():
    assert "OK" in run_on_devices(_SHARDED, n_devices=4)


def test_public_names():
    assert mw.ot.sinkhorn is ot.sinkhorn
    assert mw.ot.sinkhorn_divergence is ot.sinkhorn_divergence


@pytest.mark.parametrize("epsilon", [-1.0, 0.0])
@pytest.mark.slow
def test_traced_nonpositive_epsilon_gives_nan_not_a_number_that_looks_right(epsilon):
    x = _draw.normal(jax.random.PRNGKey(0), (6, 2))
    y = _draw.normal(jax.random.PRNGKey(1), (4, 2))
    out = jax.jit(lambda e: mw.ot.sinkhorn(x, y, epsilon=e))(epsilon)
    assert not bool(out.converged) and bool(jnp.isnan(out.reg_ot_cost))
    div = jax.jit(lambda e: mw.ot.sinkhorn_divergence(x, y, epsilon=e))(epsilon)
    assert bool(jnp.isnan(div))


@pytest.mark.slow
def test_cosine_cost_with_a_zero_point_matches_ott_with_finite_gradients():
    # A zero vector has no direction: cost 1 to every point (OTT-JAX's value too), and
    # its gradient row is zero instead of NaN spreading from sqrt's slope at 0.
    x, y, a, b = clouds(5, n=40, m=30, d=3)
    x = x.at[3].set(0.0)
    kw = dict(epsilon=0.1, cost="cosine", chunk_size=16, **TIGHT)
    value, (gx, gy) = jax.jit(
        jax.value_and_grad(lambda x, y: ot.sinkhorn(x, y, a, b, **kw).reg_ot_cost, (0, 1))
    )(x, y)
    ref, rx = jax.jit(
        jax.value_and_grad(lambda x: ott_reg_cost(x, y, a, b, 0.1, "cosine").reg_ot_cost)
    )(x)
    np.testing.assert_allclose(value, ref, rtol=1e-4)
    assert bool(jnp.all(jnp.isfinite(gx))) and bool(jnp.all(jnp.isfinite(gy)))
    np.testing.assert_array_equal(gx[3], 0.0)
    # The other rows are unaffected by the convention: same as OTT's gradient there.
    keep = jnp.arange(40) != 3
    assert rel(gx[keep], rx[keep]) < 1e-3


@pytest.mark.parametrize("transform", ["linearize", "jvp"])
def test_forward_mode_names_first_order_under_either_custom_vjp(transform):
    # Under jax_custom_vjp3 (the fast lane of make test-next-jax), linearize raised JAX's
    # bare NotImplementedError and jit of jvp its "can't apply forward-mode autodiff".
    x, y = jnp.linspace(0.0, 1.0, 8).reshape(4, 2), jnp.linspace(1.0, 0.0, 6).reshape(3, 2)

    def loss(x):
        return ot.sinkhorn(x, y, epsilon=0.5, chunk_size=2).reg_ot_cost

    fn = jax.jit(lambda x: FORWARD_MODE[transform](loss, x))
    with pytest.raises(TypeError, match="first-order reverse mode only"):
        fn(x)
    with pytest.raises(TypeError, match="first-order reverse mode only"):
        FORWARD_MODE[transform](loss, x)


@pytest.mark.parametrize("chunk_size", [pytest.param(8, marks=pytest.mark.slow), "auto"])
def test_float32_gradients_far_from_the_origin_are_the_centred_problems(chunk_size):
    # The balanced implicit gradient solves a system singular along the potentials'
    # free constant: float32 CG grew its iterate there a million-fold and stalled, and
    # the jitted gradient of plan.transport 100 from the origin came back wrong by up to
    # the gradient's size, depending on the rounding (which arguments were traced).
    rng = np.random.default_rng(6)
    x, y, z = (rng.normal(size=(k, 2)) for k in (30, 25, 5))
    y = y + 0.5

    def loss(x, y, z, threshold=1e-5):
        out = ot.sinkhorn(x, y, epsilon=0.2, threshold=threshold, chunk_size=chunk_size)
        return jnp.sum(out.plan.transport(z)) + out.reg_ot_cost

    with jax.enable_x64(True):  # compiled (eagerly, each step around the loops compiled alone)
        reference = jax.jit(jax.grad(functools.partial(loss, threshold=1e-10), (0, 1, 2)))
        want = reference(*map(jnp.asarray, (x, y, z)))
    far = [jnp.asarray(v + 100.0, jnp.float32) for v in (x, y, z)]
    grads = {
        "x, y and z": jax.jit(jax.grad(loss, (0, 1, 2)))(*far),
        "x alone": (jax.jit(jax.grad(lambda x: loss(x, *far[1:])))(far[0]),),
    }
    for name, got in grads.items():
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, atol=1e-3, err_msg=name)


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_divergence_self_terms_are_solved_about_their_own_cloud(implementation):
    # Solved about the middle of two clouds 3,000 apart, OT(x, x) was 7.5% off with the
    # fused kernel and did not converge; each self term is now about its own cloud.
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(100, 3)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(90, 3)), jnp.float32)
    alone = [ot.sinkhorn(p, p, epsilon=0.5).reg_ot_cost for p in (x, y)]
    _, (_, xx, yy) = ot.sinkhorn_divergence(
        x, y + jnp.array([3000.0, 0.0, 0.0]), epsilon=0.5, return_results=True,
        implementation=implementation,
    )  # fmt: skip
    for term, want in zip((xx, yy), alone):
        assert bool(term.converged)
        np.testing.assert_allclose(term.reg_ot_cost, want, rtol=1e-4)


@pytest.mark.slow
def test_float32_epsilon_gradients_at_small_epsilon_are_float64s():
    # The slope of a soft c-transform in epsilon is a row's KL divergence; taken through
    # the log-sum-exp's vjp it was the difference of two sums of size C / eps: at eps
    # 0.01 the gradient of <w, f> + <v, g> came back -1.44 for 0.588, with the wrong sign.
    rng = np.random.default_rng(11)
    x, y = rng.normal(size=(40, 2)), rng.normal(size=(30, 2)) + 0.3
    a, b = rng.uniform(0.2, 1, 40), rng.uniform(0.2, 1, 30)
    w, v = rng.normal(size=40), rng.normal(size=30)

    def losses(x, y, a, b, eps):
        out = ot.sinkhorn(
            x, y, a / a.sum(), b / b.sum(), epsilon=eps, threshold=1e-5, max_iterations=20_000
        )
        dual = jnp.sum(w.astype(x.dtype) * out.f) + jnp.sum(v.astype(x.dtype) * out.g)
        return jnp.stack([dual, out.reg_ot_cost])

    slopes = jax.jit(jax.jacrev(losses, 4))
    with jax.enable_x64(True):
        want = slopes(*map(jnp.asarray, (x, y, a, b)), jnp.asarray(0.01))
    got = slopes(*(jnp.asarray(u, jnp.float32) for u in (x, y, a, b)), jnp.float32(0.01))
    np.testing.assert_allclose(got, want, rtol=1e-2)
