"""Tests of ``chunk_size=None`` in memwise.ot: the solve holds the cost matrix.

Its transforms are shifted by the last ones (:func:`memwise.ot.passes.held_softmin`), so
they are checked against ``logsumexp`` for shifts near, far from and nowhere near the
answer; the solves and their gradients against the chunked solve at the same
iterations; the held matrix's memory by compiling at two sizes.
"""

from __future__ import annotations

import _draw
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from memwise import ot
from memwise.measure import compiled_memory
from memwise.ot.passes import held_softmin
from tests._multidevice import run_on_devices

TOL = {jnp.float32: 2e-5, jnp.float64: 1e-12}


def clouds(seed, n=60, m=45, d=3, dtype=jnp.float32):
    k = jax.random.split(jax.random.key(seed), 4)
    x = _draw.normal(k[0], (n, d), dtype)
    y = 0.7 * _draw.normal(k[1], (m, d), dtype) + 0.5
    a = _draw.uniform(k[2], (n,), dtype, minval=0.2)
    b = _draw.uniform(k[3], (m,), dtype, minval=0.2)
    return x, y, a / a.sum(), b / b.sum()


@pytest.mark.grid
@pytest.mark.parametrize("m", [45, 1024, 1100])  # over rows: 2 blocks of 512, and a rest
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
@pytest.mark.parametrize("axis", [0, 1])
def test_a_held_transform_is_the_logsumexp_whatever_the_shift(axis, dtype, m):
    with jax.enable_x64(dtype == jnp.float64):
        x, y, a, b = clouds(0, m=m, dtype=dtype)
        costs = jnp.sum((x[:, None] - y[None]) ** 2, -1)
        eps = jnp.asarray(0.05, dtype)
        weights = jnp.log(b if axis == 1 else a).at[3].set(-jnp.inf)  # a zero weight
        expected = -eps * jax.scipy.special.logsumexp(
            jnp.expand_dims(weights, 1 - axis) - costs / eps, axis=axis
        )
        # The answer itself, near it, far below it (sums overflow) and 0 (they underflow):
        # the last two take the max pass.
        # compiled once for the four shifts (eager, each operation compiled on its own)
        transform = jax.jit(held_softmin, static_argnames="axis")
        for previous in (expected, expected + 0.01, expected - 1e3, jnp.zeros_like(expected)):
            got = transform(costs, weights, eps, previous, axis=axis)
            assert got.dtype == dtype
            np.testing.assert_allclose(got, expected, rtol=TOL[dtype], atol=TOL[dtype])


CASES = {
    "balanced": dict(),
    "unbalanced": dict(tau_a=0.8, tau_b=0.6),
    "semi-unbalanced": dict(tau_a=0.5),
    "annealed": dict(epsilon_scaling=0.7),
    "euclidean": dict(cost="euclidean"),
    "callable": dict(cost=lambda u, v: jnp.sum(jnp.abs(u - v) ** 1.5)),
}


@pytest.mark.grid
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.slow
def test_holding_the_cost_matrix_gives_the_chunked_solve(case, dtype):
    """Same iterations, same potentials, values and gradients (to rounding)."""
    with jax.enable_x64(dtype == jnp.float64):
        x, y, a, b = clouds(1, dtype=dtype)
        fixed = dict(epsilon=0.05, max_iterations=60, min_iterations=60, **CASES[case])

        def solve(chunk_size):
            # the solve and its gradient in one compiled program (eager, every operation
            # and each loop of the solve and its backward compiled on its own)
            def cost(x, y, a):
                out = ot.sinkhorn(x, y, a, b, chunk_size=chunk_size, **fixed)
                return out.reg_ot_cost, out

            return jax.jit(jax.value_and_grad(cost, (0, 1, 2), has_aux=True))(x, y, a)

        (_, held), held_grads = solve(None)
        (_, chunked), chunked_grads = solve(16)
        assert held.f.dtype == dtype and int(held.n_iterations) == 60
        for u, v in ((held.f, chunked.f), (held.g, chunked.g)):
            np.testing.assert_allclose(u, v, rtol=TOL[dtype], atol=TOL[dtype])
        np.testing.assert_allclose(held.errors, chunked.errors, rtol=1e-3, atol=TOL[dtype])
        for u, v in zip(held_grads, chunked_grads):
            np.testing.assert_allclose(u, v, rtol=10 * TOL[dtype], atol=10 * TOL[dtype])


@pytest.mark.parametrize("case", ["balanced", "unbalanced"])
@pytest.mark.slow
def test_a_held_solve_with_more_columns_than_a_block_gives_the_chunked_solve(case):
    """m = 1,100: the transform over rows runs in blocks of 69 columns, the last
    overlapping the one before."""
    x, y, a, b = clouds(4, n=50, m=1_100)
    fixed = dict(epsilon=0.05, max_iterations=40, min_iterations=40, **CASES[case])
    held, chunked = (
        jax.jit(lambda x, y, a, b, c=c: ot.sinkhorn(x, y, a, b, chunk_size=c, **fixed))(x, y, a, b)
        for c in (None, 128)
    )
    for u, v in ((held.f, chunked.f), (held.g, chunked.g)):
        np.testing.assert_allclose(u, v, rtol=TOL[jnp.float32], atol=TOL[jnp.float32])


@pytest.mark.parametrize("tau", [1.0, 0.9])
@pytest.mark.slow
def test_holding_the_cost_matrix_gives_the_chunked_divergence_under_jit_and_vmap(tau):
    x, y, _, _ = clouds(2)
    xs = jnp.stack([x, x + 0.3])

    def loss(chunk_size):
        return lambda x: ot.sinkhorn_divergence(
            x, y, epsilon=0.1, chunk_size=chunk_size, tau_a=tau, tau_b=tau, threshold=1e-6
        )

    held = jax.jit(jax.vmap(jax.value_and_grad(loss(None))))(xs)
    chunked = jax.jit(jax.vmap(jax.value_and_grad(loss(16))))(xs)
    for u, v in zip(held, chunked):
        np.testing.assert_allclose(u, v, rtol=1e-4, atol=1e-6)

    # A warm start from the last potentials converges to the chunked one's potentials (at
    # a 1e-6 threshold float32 rounding moves the stopping iteration: 4 held, 8 chunked).
    def cold_then_warm(x, chunk_size):
        out = ot.sinkhorn(x, y, epsilon=0.1, chunk_size=chunk_size, threshold=1e-6)
        return ot.sinkhorn(
            x, y, epsilon=0.1, chunk_size=chunk_size, threshold=1e-6, init=(out.f, out.g)
        )

    starts = []
    for chunk_size in (None, 16):
        # both solves in one compiled program (eager, each compiled op by op)
        again = jax.jit(cold_then_warm, static_argnums=1)(x, chunk_size)
        assert bool(again.converged)
        starts.append(again)
    np.testing.assert_allclose(starts[0].f, starts[1].f, atol=1e-5)


@pytest.mark.slow
def test_the_held_cost_matrix_is_n_by_m_and_the_gradient_leaves_it_behind():
    """The solve holds ``4 n m`` bytes (the chunked one a tile); at twice the points the
    held solve's temporaries grow by the matrix's growth."""

    def temp(n, chunk_size, grad=False):
        x, y = jnp.zeros((n, 3)), jnp.ones((n, 3))
        fn = lambda x, y: ot.sinkhorn(x, y, epsilon=0.1, chunk_size=chunk_size).reg_ot_cost  # noqa: E731
        return compiled_memory(fn, x, y, grad=grad).temp_bytes

    small, large = temp(1_000, None), temp(2_000, None)
    assert small >= 4 * 1_000**2 and large >= 4 * 2_000**2
    assert large - small >= 0.9 * 4 * (2_000**2 - 1_000**2)
    assert temp(2_000, "auto") < 4 * 2_000**2 / 4
    # The matrix is held once: the transforms over its rows read it by column blocks
    # without copying more than one block (before: 1.49x at 2,000, a block and the
    # ragged rest copied). 3,000 columns end in an overlapping block.
    for n in (2_000, 3_000):
        assert temp(n, None) <= 1.1 * 4 * n**2, n
        # The backward is chunked: the gradient's temporaries hold the matrix once, for
        # the solve, not a second time for the backward.
        assert temp(n, None, grad=True) <= 1.1 * 4 * n**2, n


@pytest.mark.slow
def test_a_held_cost_matrix_on_a_mesh_is_a_clear_error():
    out = run_on_devices(
        """
        import jax, numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        from memwise import ot
        mesh = Mesh(np.array(jax.devices()), ("points",))
        x = jax.device_put(np.zeros((8, 2), np.float32), NamedSharding(mesh, P("points")))
        try:
            ot.sinkhorn(x, x + 1.0, epsilon=0.1, chunk_size=None)
        except ValueError as err:
            assert "chunk_size=None" in str(err) and "chunk_size='auto'" in str(err), err
            print("OK")
        """,
        n_devices=2,
    )
    assert "OK" in out
