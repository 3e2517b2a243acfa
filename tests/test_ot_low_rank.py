"""Low-rank Sinkhorn against OTT-JAX 0.6's ``LRSinkhorn``, in float64: factors, values,
plans applied to vectors and gradients; memory linear in the points; dtypes,
transformations and the errors."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _peers import ott_reference
from ott.geometry import costs as ott_costs
from ott.geometry import pointcloud
from ott.problems.linear import linear_problem
from ott.solvers.linear import sinkhorn_lr

import memwise as mw
from memwise.measure import compiled_memory

pytestmark = pytest.mark.usefixtures("float64_module")

OTT_COSTS = {"sqeuclidean": ott_costs.SqEuclidean(), "euclidean": ott_costs.Euclidean()}


def _clouds(n, m, seed=0, d=3):
    rng = np.random.default_rng(seed)
    a = rng.uniform(0.2, 1.0, n)
    b = rng.uniform(0.2, 1.0, m)
    return (
        jnp.asarray(rng.normal(size=(n, d))),
        jnp.asarray(rng.normal(size=(m, d)) + 0.5),
        jnp.asarray(a / a.sum()),
        jnp.asarray(b / b.sum()),
    )


def _ott(x, y, a, b, *, rank, cost="sqeuclidean", epsilon=0.0):
    geom = pointcloud.PointCloud(x, y, cost_fn=OTT_COSTS[cost])
    out = sinkhorn_lr.LRSinkhorn(rank, epsilon=epsilon)(linear_problem.LinearProblem(geom, a, b))
    return out.reg_ot_cost, out


def _memwise(x, y, a, b, *, rank, cost="sqeuclidean", epsilon=0.0):
    out = mw.ot.low_rank_sinkhorn(x, y, a, b, rank=rank, cost=cost, epsilon=epsilon)
    return out.reg_ot_cost, out


@pytest.mark.slow
@pytest.mark.parametrize(
    "cost, epsilon", [("sqeuclidean", 0.0), ("sqeuclidean", 0.05), ("euclidean", 0.0)]
)
def test_factors_values_plans_and_gradients_equal_ott_at_500_points(cost, epsilon):
    # Same initial factors (OTT's RandomInitializer from key 0), same steps, same
    # stopping: everything equal to 1e-5 (measured: 1e-14 relative or better).
    x, y, a, b = _clouds(500, 500)
    kw = dict(rank=10, cost=cost, epsilon=epsilon)

    def value_and_grad(solver):
        fn = lambda x, y: solver(x, y, a, b, **kw)  # noqa: E731
        return jax.jit(jax.value_and_grad(fn, (0, 1), has_aux=True))(x, y)

    (got, ours), got_grads = value_and_grad(_memwise)
    with ott_reference():
        (want, theirs), want_grads = value_and_grad(_ott)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert int(ours.n_iterations) == int(theirs.n_iters) and bool(ours.converged)
    for mine, its in ((ours.q, theirs.q), (ours.r, theirs.r), (ours.g, theirs.g)):
        np.testing.assert_allclose(mine, its, rtol=1e-5, atol=1e-5 * float(jnp.max(its)))
    v, w = jnp.asarray(np.random.default_rng(1).normal(size=(2, 500)))
    for axis, vec in ((0, v), (1, w)):
        want_applied = theirs.apply(vec, axis=axis)
        np.testing.assert_allclose(ours.apply(vec, axis=axis), want_applied, rtol=1e-5, atol=1e-12)
    np.testing.assert_allclose(ours.costs, theirs.costs, rtol=1e-5)
    for mine, its in zip(got_grads, want_grads):
        np.testing.assert_allclose(mine, its, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(its))))


@pytest.mark.slow
def test_the_plan_operator_is_the_dense_plan():
    x, y, a, b = _clouds(40, 30, seed=3)
    out = mw.ot.low_rank_sinkhorn(x, y, a, b, rank=5)
    plan = out.matrix()
    v = jnp.asarray(np.random.default_rng(2).normal(size=(3, 40)))
    np.testing.assert_allclose(out.apply(v, axis=0), v @ plan, rtol=1e-12)
    np.testing.assert_allclose(out.apply(v[:, :30], axis=1), v[:, :30] @ plan.T, rtol=1e-12)
    np.testing.assert_allclose(out.marginal(1), a, atol=1e-3)
    np.testing.assert_allclose(out.marginal(0), b, atol=1e-3)
    np.testing.assert_allclose(jnp.sum(plan, 0), out.marginal(0), rtol=1e-12)
    # the cost read off the plan: OTT's primal cost at epsilon = 0
    c = jnp.sum((x[:, None] - y[None]) ** 2, -1)
    np.testing.assert_allclose(out.reg_ot_cost, jnp.sum(c * plan), rtol=1e-12)


@pytest.mark.slow
def test_a_callable_cost_and_its_parameters_get_the_chunked_gradient():
    # A learned metric closed over: the chunked passes carry it, and its gradient is
    # the dense one at the same factors.
    x, y, a, b = _clouds(60, 50, seed=4)
    scale = jnp.asarray([1.0, 2.0, 0.5])

    def cost_of(scale):
        return lambda u, v: jnp.sum(scale * (u - v) ** 2)

    def ours(x, scale):
        out = mw.ot.low_rank_sinkhorn(x, y, a, b, rank=4, cost=cost_of(scale), chunk_size=16)
        return out.reg_ot_cost, out

    (value, out), grads = jax.value_and_grad(ours, (0, 1), has_aux=True)(x, scale)

    def dense(x, scale):  # the same factors, held: Danskin's gradient
        c = jnp.sum(scale * (x[:, None] - y[None]) ** 2, -1)
        return jnp.sum(c * out.matrix())

    np.testing.assert_allclose(value, dense(x, scale), rtol=1e-10)
    for mine, want in zip(grads, jax.grad(dense, (0, 1))(x, scale)):
        np.testing.assert_allclose(mine, want, rtol=1e-9, atol=1e-12)
    # the same problem, as a squared Euclidean cost of rescaled points
    rescaled = mw.ot.low_rank_sinkhorn(x * jnp.sqrt(scale), y * jnp.sqrt(scale), a, b, rank=4)
    np.testing.assert_allclose(value, rescaled.reg_ot_cost, rtol=1e-8)


@pytest.mark.slow
def test_a_held_cost_matrix_gives_the_chunked_solve():
    # chunk_size=None forms the Euclidean cost matrix once and multiplies by it: the
    # same steps as the chunked passes, the same cost and gradient.
    x, y, a, b = _clouds(70, 50, seed=8)

    def run(chunk_size):
        fn = lambda x, y: mw.ot.low_rank_sinkhorn(  # noqa: E731
            x, y, a, b, rank=4, cost="euclidean", chunk_size=chunk_size
        )
        return jax.value_and_grad(lambda x, y: fn(x, y).reg_ot_cost, (0, 1))(x, y), fn(x, y)

    (held, held_grads), held_out = run(None)
    (chunked, chunked_grads), chunked_out = run(16)
    assert int(held_out.n_iterations) == int(chunked_out.n_iterations)
    np.testing.assert_allclose(held, chunked, rtol=1e-10)
    for mine, want in zip(held_grads, chunked_grads):
        np.testing.assert_allclose(mine, want, rtol=1e-8, atol=1e-12)


@pytest.mark.slow
def test_clouds_far_from_the_origin_are_solved_as_the_centred_clouds():
    # The rank-(d + 2) expansion about the origin loses |x|^2 + |y|^2 - 2 x.y to float32
    # rounding: 1,000 from the origin the cost was 7.9% off the centred problem's.
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(300, 3)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(280, 3)), jnp.float32)
    far = mw.ot.low_rank_sinkhorn(x + 1000.0, y + 1000.0, rank=4).reg_ot_cost
    near = mw.ot.low_rank_sinkhorn(x, y, rank=4).reg_ot_cost
    np.testing.assert_allclose(far, near, rtol=1e-4)


def test_an_explicit_init_is_where_the_steps_start():
    x, y, a, b = _clouds(50, 40, seed=5)
    geom = pointcloud.PointCloud(x, y)
    problem = linear_problem.LinearProblem(geom, a, b)
    init = sinkhorn_lr.LRSinkhorn(3).initializer(problem, rng=jax.random.key(7))
    # compiled (eagerly, each step around the loops compiled on its own)
    solve = jax.jit(functools.partial(mw.ot.low_rank_sinkhorn, rank=3))
    ours = solve(x, y, a, b, init=init)
    with ott_reference():
        theirs = jax.jit(lambda problem, init: sinkhorn_lr.LRSinkhorn(3)(problem, init=init))(
            problem, init
        )
    np.testing.assert_allclose(ours.reg_ot_cost, theirs.reg_ot_cost, rtol=1e-10)
    by_key = solve(x, y, a, b, rng=jax.random.key(7))
    np.testing.assert_allclose(by_key.q, ours.q, rtol=1e-12)


@pytest.mark.slow
def test_half_precision_is_solved_in_float32_and_vmap_is_the_loop():
    x, y, _, _ = _clouds(40, 30, seed=6)
    with jax.enable_x64(False):
        x32, y32 = x.astype(jnp.float32), y.astype(jnp.float32)
        solve = jax.jit(lambda x, y: mw.ot.low_rank_sinkhorn(x, y, rank=3))
        want = solve(x32, y32).reg_ot_cost
        grad = jax.jit(jax.grad(lambda x: mw.ot.low_rank_sinkhorn(x, y32, rank=3).reg_ot_cost))
        for dtype in (jnp.bfloat16, jnp.float16):
            out = solve(x32.astype(dtype), y32.astype(dtype))
            fields = (out.reg_ot_cost, out.q, out.r, out.g, out.costs, out.errors, out.epsilon)
            assert all(v.dtype == dtype for v in fields)
            assert out.apply(jnp.ones(40, dtype)).dtype == dtype
            assert grad(x32.astype(dtype)).dtype == dtype
            np.testing.assert_allclose(float(out.reg_ot_cost), float(want), rtol=3e-2)
        xs = jnp.stack([x32, x32 + 1.0])
        fn = lambda x: mw.ot.low_rank_sinkhorn(x, y32, rank=3).reg_ot_cost  # noqa: E731
        one = jax.jit(fn)
        np.testing.assert_allclose(jax.jit(jax.vmap(fn))(xs), [one(xi) for xi in xs], rtol=1e-5)
        grads = jax.jit(jax.vmap(jax.grad(fn)))(xs)
        np.testing.assert_allclose(grads[1], jax.jit(jax.grad(fn))(xs[1]), rtol=1e-4, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("cost", ["sqeuclidean", "euclidean"])
def test_memory_grows_with_the_points_not_their_pairs(cost):
    # value_and_grad at 8,000 and 32,000 points a side, rank 8: temporaries grow 4x
    # with the points (the dense plan would grow 16x; at 32,000 points it is 4 GB).
    def temps(n):
        x = jax.ShapeDtypeStruct((n, 3), jnp.float32)

        def loss(x, y):
            return mw.ot.low_rank_sinkhorn(x, y, rank=8, cost=cost, chunk_size=256).reg_ot_cost

        return compiled_memory(jax.jit(jax.value_and_grad(loss, (0, 1))), x, x).temp_bytes

    with jax.enable_x64(False):
        small, large = temps(8000), temps(32000)
    assert large < 4.5 * small, (small, large)
    assert large < 20 * 32000 * 8 * 4, large  # twenty [n, rank] float32 arrays


def test_bad_input_is_one_clear_error():
    x, y, a, b = _clouds(10, 8)
    cases = [
        (dict(rank=0), ValueError, "rank must be a positive int"),
        (dict(rank=9), ValueError, r"rank must be at most min\(n, m\) = 8"),
        (dict(rank=2.5), TypeError, "rank must be a positive int"),
        (dict(rank=2, epsilon=-0.1), ValueError, "epsilon must be finite and >= 0"),
        (dict(rank=2, gamma=0.0), ValueError, "gamma must be finite and > 0"),
        (dict(rank=2, threshold=float("nan")), ValueError, "threshold must be finite"),
        (dict(rank=2, gamma_rescale=1), TypeError, "gamma_rescale must be a bool"),
        (dict(rank=2, min_iterations=-1), ValueError, "min_iterations must be an int >= 0"),
        (dict(rank=2, init=(x, y)), TypeError, r"init must be a tuple \(q, r, g\) of three"),
        (dict(rank=2, init=(x, y, b)), ValueError, r"init must be \(q, r, g\) of shapes"),
        (dict(rank=2, cost="manhattan"), ValueError, "cost must be one of"),
    ]
    for kw, error, message in cases:
        with pytest.raises(error, match=message):
            mw.ot.low_rank_sinkhorn(x, y, a, b, **kw)
    with pytest.raises(ValueError, match="same dimension"):
        mw.ot.low_rank_sinkhorn(x, y[:, :2], rank=2)
    with pytest.raises(ValueError, match="a has negative weights"):
        mw.ot.low_rank_sinkhorn(x, y, -a, b, rank=2)
    out = jax.jit(functools.partial(mw.ot.low_rank_sinkhorn, rank=2))(x, y, a, b)  # compiled
    with pytest.raises(ValueError, match="axis must be 0"):
        out.apply(a, axis=2)


def test_gradients_in_the_weights_and_forward_mode_raise_naming_the_fix():
    x, y, a, b = _clouds(10, 8)
    cost = lambda x, a: mw.ot.low_rank_sinkhorn(x, y, a, b, rank=2).reg_ot_cost  # noqa: E731
    with pytest.raises(TypeError, match="not the weights a and b"):
        jax.grad(cost, 1)(x, a)
    with pytest.raises(TypeError, match="first-order reverse mode only"):
        jax.jvp(lambda x: cost(x, a), (x,), (jnp.ones_like(x),))
    assert jax.grad(cost)(x, a).shape == x.shape  # the points alone: fine
