"""Unbalanced OT, the plan as an operator, entropic maps and the new costs/options of
``mw.ot``, against OTT-JAX 0.6 (dense) and finite differences."""

from __future__ import annotations

import functools
import warnings

import _draw
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ott.geometry import costs as ott_costs
from ott.geometry import pointcloud
from ott.problems.linear import linear_problem
from ott.solvers.linear import sinkhorn as ott_sinkhorn
from ott.tools import sinkhorn_divergence as ott_divergence

from memwise import ot
from memwise.measure import compiled_memory

EPS = 0.5
TIGHT = dict(threshold=1e-6, max_iterations=5000)
# sinkhorn's options that decide the program, static under jit
_OPTIONS = ("tau_a", "tau_b", "reach", "cost", "chunk_size")


# compiled: eager, each random draw and operation compiled on its own, for every size
@functools.partial(jax.jit, static_argnames=("n", "m", "d", "mass_a"))
def clouds(seed, n=500, m=500, d=2, mass_a=1.3):
    k = jax.random.split(jax.random.key(seed), 4)
    x = _draw.normal(k[0], (n, d))
    y = 0.7 * _draw.normal(k[1], (m, d)) + 1.0
    a = _draw.uniform(k[2], (n,), minval=0.2)
    b = _draw.uniform(k[3], (m,), minval=0.2)
    return x, y, mass_a * a / a.sum(), b / b.sum()


def rel(u, v):
    return float(jnp.linalg.norm(u - v) / jnp.linalg.norm(v))


# Compiled: a reference, run eagerly, compiled OTT's set-up op by op and its loop again
# at each call. (OTT's costs are pytrees, so cost_fn is an argument; the relaxations
# decide the problem's form in Python.)
@functools.partial(jax.jit, static_argnames=("tau_a", "tau_b", "threshold"))
def ott_solve(x, y, a, b, tau_a, tau_b, cost_fn=None, threshold=1e-6):
    geom = pointcloud.PointCloud(x, y, epsilon=EPS, cost_fn=cost_fn)
    # use_danskin=False: OTT's unbalanced reg_ot_cost is not stationary at its own
    # fixed point, so its Danskin gradient is not the derivative; implicit is.
    solver = ott_sinkhorn.Sinkhorn(use_danskin=False, threshold=threshold, max_iterations=5000)
    return solver(linear_problem.LinearProblem(geom, a, b, tau_a=tau_a, tau_b=tau_b))


@pytest.mark.parametrize(
    "tau_a,tau_b",
    [(0.8, 0.6), pytest.param(1.0, 0.7, marks=pytest.mark.slow)],
)
@pytest.mark.slow
def test_unbalanced_values_potentials_and_gradients_match_ott(tau_a, tau_b):
    x, y, a, b = clouds(0)

    def ours(x, a, b):
        out = ot.sinkhorn(
            x, y, a, b, epsilon=EPS, tau_a=tau_a, tau_b=tau_b, chunk_size=128, **TIGHT
        )
        return out.reg_ot_cost, out

    def theirs(x, a, b):
        out = ott_solve(x, y, a, b, tau_a, tau_b, threshold=1e-10)
        return out.reg_ot_cost, (out.f, out.g)

    (value, out), grads = jax.jit(jax.value_and_grad(ours, (0, 1, 2), has_aux=True))(x, a, b)
    # OTT in float64, converged to 1e-10.
    with jax.enable_x64():
        wide = [v.astype(jnp.float64) for v in (x, y, a, b)]
        y = wide[1]
        (ref, (ref_f, ref_g)), ref_grads = jax.jit(
            jax.value_and_grad(theirs, (0, 1, 2), has_aux=True)
        )(wide[0], wide[2], wide[3])
    assert bool(out.converged)
    np.testing.assert_allclose(value, ref, rtol=1e-5)
    # OTT's potentials are ours plus eps log(weights); no free constant when unbalanced.
    assert rel(out.f, ref_f - EPS * jnp.log(a)) < 1e-5
    assert rel(out.g, ref_g - EPS * jnp.log(b)) < 1e-5
    # Semi-unbalanced, OTT's implicit gradient (even in float64) is 2.4e-5 from ours,
    # which matches finite differences to 1e-6 (next test): its linear solve's tolerance.
    tolerance = 1e-5 if tau_a < 1 else 3e-5
    for g, r in zip(grads, ref_grads):
        assert rel(g, r) < tolerance


@pytest.mark.parametrize("tau_a,tau_b", [(0.8, 0.6), (1.0, 0.7)])
@pytest.mark.slow
def test_unbalanced_gradient_is_the_derivative_in_float64(tau_a, tau_b):
    with jax.enable_x64():
        x, y, a, b = (v.astype(jnp.float64) for v in clouds(1, n=30, m=33))

        def fn(x, a, b):
            return ot.sinkhorn(
                x, y, a, b, epsilon=EPS, tau_a=tau_a, tau_b=tau_b, threshold=1e-12,
                max_iterations=20_000,
            ).reg_ot_cost  # fmt: skip

        grads = jax.jit(jax.grad(fn, (0, 1, 2)))(x, a, b)
        value = jax.jit(fn)  # the finite differences' six evaluations, compiled once
        h = 1e-5
        for i, (arg, grad) in enumerate(zip((x, a, b), grads)):
            direction = _draw.normal(jax.random.key(i), arg.shape, jnp.float64)
            args = [x, a, b]
            plus, minus = list(args), list(args)
            plus[i], minus[i] = arg + h * direction, arg - h * direction
            fd = (value(*plus) - value(*minus)) / (2 * h)
            np.testing.assert_allclose(jnp.sum(grad * direction), fd, rtol=1e-6)


@pytest.mark.slow
def test_unbalanced_divergence_matches_ott():
    x, y, a, b = clouds(2, n=200, m=150)
    kw = dict(epsilon=EPS, tau_a=0.9, tau_b=0.9, chunk_size=64, **TIGHT)
    value, grads = jax.jit(
        jax.value_and_grad(lambda x, a, b: ot.sinkhorn_divergence(x, y, a, b, **kw), (0, 1, 2))
    )(x, a, b)

    def theirs(x, a, b):
        return ott_divergence.sinkhorn_divergence(
            pointcloud.PointCloud,
            x,
            y,
            a=a,
            b=b,
            epsilon=EPS,
            solve_kwargs=dict(use_danskin=False, tau_a=0.9, tau_b=0.9, **TIGHT),
        )[0]

    ref, ref_grads = jax.jit(jax.value_and_grad(theirs, (0, 1, 2)))(x, a, b)
    np.testing.assert_allclose(value, ref, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        assert rel(g, r) < 1e-4


@pytest.mark.slow
def test_reach_is_geomloss_spelling_of_tau():
    x, y, a, b = clouds(3, n=60, m=50)
    reach = 0.8
    tau = reach**2 / (reach**2 + EPS)
    # compiled (eager, every operation and loop of a solve compiled on its own)
    solve = jax.jit(functools.partial(ot.sinkhorn, epsilon=EPS, **TIGHT), static_argnames=_OPTIONS)
    by_reach = solve(x, y, a, b, reach=reach)
    by_tau = solve(x, y, a, b, tau_a=tau, tau_b=tau)
    np.testing.assert_allclose(by_reach.reg_ot_cost, by_tau.reg_ot_cost, rtol=1e-6)
    np.testing.assert_allclose(by_reach.f, by_tau.f, rtol=1e-5, atol=1e-6)
    # euclidean: rho = reach**1
    out = solve(x, y, a, b, cost="euclidean", reach=reach)
    ref = ott_solve(x, y, a, b, reach / (reach + EPS), reach / (reach + EPS), ott_costs.Euclidean())
    np.testing.assert_allclose(out.reg_ot_cost, ref.reg_ot_cost, rtol=1e-5)


def _plan_operations(out, v):
    """A plan's products, marginals and cost: ours (methods) or OTT-JAX's (attributes)."""
    ops = {}
    for axis in (0, 1):
        ops[f"apply {axis}"] = out.apply(v, axis=axis)
        ops[f"apply one {axis}"] = out.apply(v[0], axis=axis)
        ops[f"marginal {axis}"] = out.marginal(axis)
    return ops


@pytest.mark.slow
def test_plan_operator_and_entropic_map_match_ott_dense():
    x, y, a, b = clouds(4)
    v = _draw.normal(jax.random.key(5), (3, 500))
    z = _draw.normal(jax.random.key(6), (40, 2))
    uniform_weights = jnp.full(500, 1 / 500)

    # Each side's operations in one compiled program (eager, each operation of each
    # chunked pass compiled on its own: 277 compilations in this test).
    @jax.jit
    def ours(x, y, a, b):
        out = ot.sinkhorn(x, y, a, b, epsilon=EPS, tau_a=0.8, tau_b=0.7, chunk_size=128, **TIGHT)
        uniform = ot.sinkhorn(x, y, epsilon=EPS, **TIGHT)
        return _plan_operations(out, v) | {
            "cost": out.transport_cost(),
            "matrix": out.matrix(),
            "transport": out.transport(),
            "uniform transport": uniform.transport(z),
        }

    @jax.jit
    def theirs(x, y, a, b):
        ref = ott_solve(x, y, a, b, 0.8, 0.7)
        ref_uniform = ott_solve(x, y, uniform_weights, uniform_weights, 1.0, 1.0)
        return _plan_operations(ref, v) | {
            "cost": ref.primal_cost,
            "matrix": ref.matrix,
            "uniform transport": ref_uniform.to_dual_potentials().transport(z),
        }

    got, want = ours(x, y, a, b), theirs(x, y, a, b)
    for name in [k for k in want if k.startswith(("apply", "marginal"))]:
        assert rel(got[name], want[name]) < 1e-5, name
    np.testing.assert_allclose(got["cost"], want["cost"], rtol=1e-5)
    assert rel(got["matrix"], want["matrix"]) < 1e-5
    # The barycentric map of new points is P's row-normalised average of y; OTT's
    # to_dual_potentials weighs by b twice (its g holds eps log b, then b again), so
    # it agrees with it only for uniform b: compare with OTT's dense plan instead.
    plan = want["matrix"]
    assert rel(got["transport"], plan @ y / plan.sum(1, keepdims=True)) < 1e-5
    assert rel(got["uniform transport"], want["uniform transport"]) < 1e-5
    dense = jax.jit(
        lambda x, a: ot.sinkhorn(x, y, a, b, epsilon=EPS, tau_a=0.8, tau_b=0.7, **TIGHT)
    )(jnp.concatenate([x, z]), jnp.concatenate([a, jnp.zeros(40)]))
    assert dense.plan.shape == (540, 500)


@pytest.mark.slow
def test_plan_operations_are_differentiable_like_dense_jax():
    x, y, a, b = clouds(7, n=40, m=30)
    z = _draw.normal(jax.random.key(8), (5, 2))
    v = _draw.normal(jax.random.key(9), (30,))
    kw = dict(epsilon=EPS, tau_a=0.8, tau_b=0.7, **TIGHT)

    def ours(x, z):
        out = ot.sinkhorn(x, y, a, b, chunk_size=8, **kw)
        return (
            jnp.sum(out.transport(z) ** 2)
            + jnp.sum(out.apply(v, axis=1) ** 2)
            + out.transport_cost()
            + jnp.sum(out.marginal(0) ** 2)
        )

    def dense(x, z):
        out = ott_solve(x, y, a, b, 0.8, 0.7)
        plan = out.matrix
        cz = jnp.sum((z[:, None] - y[None]) ** 2, -1)
        w = jax.nn.softmax(jnp.log(b) + (out.g - EPS * jnp.log(b) - cz) / EPS, axis=1)
        cost = jnp.sum((x[:, None] - y[None]) ** 2, -1)
        return (
            jnp.sum((w @ y) ** 2)
            + jnp.sum((plan @ v) ** 2)
            + jnp.sum(plan * cost)
            + jnp.sum(plan.sum(0) ** 2)
        )

    grads = jax.jit(jax.grad(ours, (0, 1)))(x, z)
    ref = jax.jit(jax.grad(dense, (0, 1)))(x, z)
    for g, r in zip(grads, ref):
        assert rel(g, r) < 1e-4


def test_unequal_masses_are_supported_when_unbalanced():
    x, y, a, b = clouds(10, n=20, m=30, mass_a=3.0)
    with pytest.raises(ValueError, match="relax a marginal"):
        ot.sinkhorn(x, y, a, b, epsilon=0.5)
    out = ot.sinkhorn(x, y, a, b, epsilon=0.5, tau_a=0.9, tau_b=0.9)
    assert bool(out.converged) and np.isfinite(float(out.reg_ot_cost))


def test_bad_unbalanced_options_raise():
    x, y, a, b = clouds(11, n=20, m=30)
    for tau in (0.0, -0.5, 1.5, float("nan")):
        with pytest.raises(ValueError, match="tau_a must be in"):
            ot.sinkhorn(x, y, epsilon=0.5, tau_a=tau)
    with pytest.raises(TypeError, match="tau_b must be a float"):
        ot.sinkhorn(x, y, epsilon=0.5, tau_b="0.5")
    with pytest.raises(ValueError, match="either reach"):
        ot.sinkhorn(x, y, epsilon=0.5, tau_a=0.5, reach=1.0)
    with pytest.raises(ValueError, match="reach must be"):
        ot.sinkhorn_divergence(x, y, epsilon=0.5, reach=-1.0)
    with pytest.raises(ValueError, match="pass tau_a and tau_b instead"):
        ot.sinkhorn(x, y, epsilon=0.5, cost="cosine", reach=1.0)
    with pytest.raises(ValueError, match="min_iterations"):
        ot.sinkhorn(x, y, epsilon=0.5, min_iterations=10, max_iterations=5)
    with pytest.raises(ValueError, match="negative"):
        ot.sinkhorn(x, y, a.at[0].set(-1.0), b, epsilon=0.5, tau_a=0.5)
    with pytest.raises(ValueError, match="same dimension"):
        ot.sinkhorn(x, jnp.ones((30, 3)), epsilon=0.5, tau_a=0.5)
    with pytest.raises(TypeError, match="returning a scalar|must return a scalar"):
        ot.sinkhorn(x, y, epsilon=0.5, cost=lambda u, v: u - v)
    with pytest.raises(TypeError, match="function of two points"):
        ot.sinkhorn(x, y, epsilon=0.5, cost=lambda u: jnp.sum(u))
    with pytest.raises(ValueError, match="p must be"):
        ot.PNormP(0.5)
    out = ot.sinkhorn(x, y, epsilon=0.5)
    with pytest.raises(ValueError, match="axis must be"):
        out.apply(jnp.ones(20), axis=2)
    with pytest.raises(ValueError, match=r"v must have shape \[30\]"):
        out.apply(jnp.ones(20), axis=1)
    with pytest.raises(ValueError, match="points must be"):
        out.transport(jnp.ones((4, 3)))


def test_matrix_warns_above_its_size_threshold(monkeypatch):
    from memwise.ot import plan as plan_module

    x, y, _, _ = clouds(12, n=20, m=30)
    out = ot.sinkhorn(x, y, epsilon=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        small = out.matrix()
    monkeypatch.setattr(plan_module, "MATRIX_WARNING_SIZE", 100)
    with pytest.warns(ResourceWarning, match="apply"):
        big = out.matrix()
    np.testing.assert_allclose(small, big)
    np.testing.assert_allclose(small.sum(1), out.marginal(1), rtol=1e-5)


@pytest.mark.slow
def test_pnorm_and_point_function_costs_match_ott():
    x, y, a, b = clouds(13, n=60, m=50)

    # each cost's value and gradient in one compiled program (eager, op by op)
    def solve(cost):
        def both(x, a):
            value = ot.sinkhorn(x, y, a, b, epsilon=EPS, cost=cost, **TIGHT).reg_ot_cost
            grad = jax.grad(lambda x: ot.sinkhorn(x, y, epsilon=EPS, cost=cost).reg_ot_cost)(x)
            return value, grad

        return jax.jit(both)(x, a / 1.3)

    out, g_pnorm = solve(ot.PNormP(1.5))
    ref = ott_solve(x, y, a / 1.3, b, 1.0, 1.0, ott_costs.PNormP(1.5))
    np.testing.assert_allclose(out, ref.reg_ot_cost, rtol=1e-5)
    # A user cost, a function of two points, traced once for the tile.
    user = lambda u, v: jnp.sum(jnp.abs(u - v) ** 1.5) / 1.5  # noqa: E731
    mine, g_user = solve(user)
    np.testing.assert_allclose(mine, out, rtol=1e-6)
    assert rel(g_user, g_pnorm) < 1e-5


@pytest.mark.slow
def test_min_iterations_and_warm_start():
    x, y, a, b = clouds(14, n=60, m=50)
    solve = jax.jit(
        functools.partial(ot.sinkhorn, epsilon=EPS, tau_a=0.8, tau_b=0.8, threshold=1e-5),
        static_argnames="min_iterations",
    )  # compiled (eager, each operation compiled on its own)
    cold = solve(x, y, a, b)
    assert int(cold.n_iterations) > 3
    forced = solve(x, y, a, b, min_iterations=60)
    assert int(forced.n_iterations) == 60 and bool(forced.converged)
    assert np.all(np.asarray(forced.errors[:60]) >= 0)
    warm = solve(x, y, a, b, init=(cold.f, cold.g))
    assert int(warm.n_iterations) <= 2 and bool(warm.converged)
    np.testing.assert_allclose(warm.reg_ot_cost, cold.reg_ot_cost, rtol=1e-5)


@pytest.mark.slow
def test_unbalanced_gradient_memory():
    """The envelope gradient within 1.2x of the balanced one; the exact one O(n + m)."""

    def temps(n, **kw):
        x, y = jnp.zeros((n, 2)), jnp.ones((n, 2))
        fn = lambda x, y: ot.sinkhorn_divergence(x, y, epsilon=0.1, **kw)  # noqa: E731
        return compiled_memory(fn, x, y, grad=True).temp_bytes

    relaxed = dict(tau_a=0.9, tau_b=0.9)
    exact, balanced = {}, {}
    for n in (20_000, 50_000):
        balanced[n] = temps(n)
        envelope = temps(n, cost_gradient="envelope", **relaxed)
        exact[n] = temps(n, **relaxed)
        assert envelope <= 1.2 * balanced[n], (n, envelope, balanced[n])
        assert exact[n] < 16 * 2**20  # one 50,000 x 50,000 float32 matrix: 9.3 GiB
    # 30,000 more points add O(n) vectors (about 180 bytes a point), no matrix; when each
    # chunked pass's zero accumulators were made at the start of the program and held
    # through the others, 240 bytes a point.
    for temp in (exact, balanced):
        assert temp[50_000] - temp[20_000] < 200 * 30_000, temp


@pytest.mark.slow
def test_envelope_gradient_is_otts_danskin_gradient():
    x, y, a, b = clouds(15, n=200, m=150)
    kw = dict(epsilon=EPS, tau_a=0.8, tau_b=0.7, **TIGHT)
    grads = jax.jit(
        jax.grad(
            lambda x, a: ot.sinkhorn(x, y, a, b, cost_gradient="envelope", **kw).reg_ot_cost,
            (0, 1),
        )
    )(x, a)

    def theirs(x, a):
        geom = pointcloud.PointCloud(x, y, epsilon=EPS)
        solver = ott_sinkhorn.Sinkhorn(use_danskin=True, **TIGHT)
        return solver(linear_problem.LinearProblem(geom, a, b, tau_a=0.8, tau_b=0.7)).reg_ot_cost

    ref = jax.jit(jax.grad(theirs, (0, 1)))(x, a)
    for g, r in zip(grads, ref):
        assert rel(g, r) < 1e-5
    with pytest.raises(ValueError, match="cost_gradient"):
        ot.sinkhorn(x, y, cost_gradient="danskin")
