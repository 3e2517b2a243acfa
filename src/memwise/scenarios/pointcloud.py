"""Scenario ``pointcloud``: the gradient of a Sinkhorn divergence between discs.

OTT-JAX issue 417: the user compares two clouds of 50,000 points drawn uniformly from
discs of radius 5 and 10 with OTT-JAX's ``sinkhorn_divergence`` (default epsilon,
``use_danskin=True``) and needs its gradient in ``x``. OTT's online
``PointCloud(batch_size=...)`` chunks only the forward pass, so the gradient
materialises the 50,000 x 50,000 cost matrix several times (29.8 GiB in the report). The
naive program here is the same algorithm written with dense matrices in plain JAX (what
fits in memory only for small clouds); the memwise program is
``mw.ot.sinkhorn_divergence``, whose forward and backward passes are chunked.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from memwise import ot
from memwise.scenarios import Scenario

SIZES = {
    "default": dict(n=1500, radius_x=5.0, radius_y=10.0, threshold=1e-3),
    "report": dict(n=50_000, radius_x=5.0, radius_y=10.0, threshold=1e-3),
}


def disc(radius: float, n: int, key: jax.Array) -> jax.Array:
    """``n`` points uniform in a disc (the report's sampler: sqrt for uniform area)."""
    key_r, key_phi = jax.random.split(key)
    r = radius * jnp.sqrt(jax.random.uniform(key_r, (n,)))
    phi = 2 * jnp.pi * jax.random.uniform(key_phi, (n,))
    return jnp.stack((r * jnp.cos(phi), r * jnp.sin(phi)), axis=1)


def report_clouds(
    n: int, radius_x: float = 5.0, radius_y: float = 10.0
) -> tuple[jax.Array, jax.Array]:
    """The clouds of OTT-JAX issue 417 (both discs sampled with one key, ``key_x``)."""
    key = jax.random.PRNGKey(42)
    key, key_x, key_y = jax.random.split(key, 3)
    return disc(radius_x, n, key_x), disc(radius_y, n, key_x)


# ---- The naive program: the same algorithm with dense matrices, plain JAX. ------------


def _dense_cost(x, y):
    return jnp.sum(x**2, 1)[:, None] + jnp.sum(y**2, 1)[None, :] - 2 * x @ y.T


def _dense_reg_ot(x, y, eps, threshold, max_iterations=2000):
    n, m = x.shape[0], y.shape[0]
    log_a, log_b = jnp.full((n,), -jnp.log(n)), jnp.full((m,), -jnp.log(m))
    cost = jax.lax.stop_gradient(_dense_cost(x, y))

    def t_b(g):
        return -eps * jax.nn.logsumexp(log_b[None] + (g[None] - cost) / eps, axis=1)

    def t_a(f):
        return -eps * jax.nn.logsumexp(log_a[:, None] + (f[:, None] - cost) / eps, axis=0)

    def body(state):
        it, _, _, g_next, _ = state
        g = g_next
        f = t_b(g)
        g_next = t_a(f)
        error = jnp.sum(jnp.abs(jnp.expm1((g - g_next) / eps))) / m
        return it + 1, f, g, g_next, error

    def cond(state):
        return (state[0] < max_iterations) & (state[4] >= threshold)

    zeros_n, zeros_m = jnp.zeros((n,)), jnp.zeros((m,))
    _, f, g, _, _ = jax.lax.while_loop(cond, body, (0, zeros_n, zeros_m, zeros_m, jnp.inf))
    f, g = jax.lax.stop_gradient((f, g))
    plan = jnp.exp((f[:, None] + g[None] - _dense_cost(x, y)) / eps) / float(n * m)
    return jnp.mean(f) + jnp.mean(g) + eps * (1.0 - jnp.sum(plan))


def _dense_reg_ot_self(x, eps, threshold, max_iterations=2000):
    n = x.shape[0]
    log_a = jnp.full((n,), -jnp.log(n))
    cost = jax.lax.stop_gradient(_dense_cost(x, x))

    def body(state):
        it, f, _ = state
        t = -eps * jax.nn.logsumexp(log_a[None] + (f[None] - cost) / eps, axis=1)
        error = 2 * jnp.sum(jnp.abs(jnp.expm1((f - t) / eps))) / n
        return it + 1, jnp.where(error < threshold, f, 0.5 * (f + t)), error

    def cond(state):
        return (state[0] < max_iterations) & (state[2] >= threshold)

    _, f, _ = jax.lax.while_loop(cond, body, (0, jnp.zeros((n,)), jnp.inf))
    f = jax.lax.stop_gradient(f)
    plan = jnp.exp((f[:, None] + f[None] - _dense_cost(x, x)) / eps) / float(n * n)
    return 2 * jnp.mean(f) + eps * (1.0 - jnp.sum(plan))


def dense_divergence(x, y, threshold=1e-3):
    """OTT's default epsilon (0.05 x std of the cost matrix) and divergence, dense."""
    eps = jax.lax.stop_gradient(0.05 * jnp.std(_dense_cost(x, y)))
    return _dense_reg_ot(x, y, eps, threshold) - 0.5 * (
        _dense_reg_ot_self(x, eps, threshold) + _dense_reg_ot_self(y, eps, threshold)
    )


def make(n: int, radius_x: float, radius_y: float, threshold: float) -> Scenario:
    x, y = report_clouds(n, radius_x, radius_y)

    def naive(x, y):
        return jax.value_and_grad(dense_divergence)(x, y, threshold)

    def memwise(x, y):
        return jax.value_and_grad(lambda x: ot.sinkhorn_divergence(x, y, threshold=threshold))(x)

    return Scenario(
        name="pointcloud",
        description=(
            f"value and x-gradient of the Sinkhorn divergence between {n:,} points "
            f"in discs of radius {radius_x:g} and {radius_y:g} (default epsilon)"
        ),
        naive=naive,
        memwise=memwise,
        args=(x, y),
        rtol=1e-3,
        atol=1e-6,
    )
