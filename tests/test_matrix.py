"""The reliability matrix: every public primitive x dtype x transformation x edge shape,
against the dense JAX computation in float64, plus the documented error where a
transformation is not supported.

Each primitive is a ``Case``: ``build(n, chunk, dtype)`` gives ``(memwise_fn, dense_fn,
args)`` for float inputs of that dtype. The dense function is evaluated on the same
inputs upcast to float64, and the memwise result must agree within the dtype's
tolerance (relative to the result's scale). Forward mode (``jvp``) of a ``custom_vjp``
primitive must raise a ``TypeError`` (the documented limit), never give a wrong value.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import _draw
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _attention_reference import dense_attention
from _close import TOLERANCE, assert_close

import memwise as mw
import memwise.nt as nt

pytestmark = pytest.mark.usefixtures("float64_module")


DTYPES = {
    "float32": jnp.float32,
    "float64": jnp.float64,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
}
# (n, chunk): one item, chunk larger than n, chunk of one, a ragged last chunk.
SHAPES = {"one": (1, 1), "chunk>n": (3, 8), "chunk=1": (4, 1), "ragged": (7, 3)}


@dataclasses.dataclass(frozen=True)
class Case:
    build: Callable  # (n, chunk, dtype) -> (memwise_fn, dense_fn, args)
    forward_mode: bool = False  # True when jvp is supported (else a TypeError)
    # An iterative solver stopped at a threshold agrees with the reference to about it.
    min_tolerance: float = 0.0


def _inputs(dtype, *shapes, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
    return tuple(
        (_draw.uniform(k, s, jnp.float64, -1.0, 1.0)).astype(dtype) for k, s in zip(keys, shapes)
    )


def _chunked_map(n, chunk, dtype):
    args = _inputs(dtype, (n, 3), (3, 3))

    def f(xs, w):
        return mw.chunked_map(lambda x: jnp.tanh(w @ x), xs, chunk_size=chunk)

    return f, lambda xs, w: jnp.tanh(xs @ w.T), args


def _chunked_sum(n, chunk, dtype):
    args = _inputs(dtype, (n, 3), (3, 3))

    def f(xs, w):
        return mw.chunked_sum(lambda x: jnp.sin(w @ x), xs, chunk_size=chunk)

    return f, lambda xs, w: jnp.sum(jnp.sin(xs @ w.T), 0), args


def _pairwise(reduce):
    def build(n, chunk, dtype):
        args = _inputs(dtype, (n, 2), (n + 2, 2), (n + 2,))
        fn = lambda a, b: -jnp.sum((a - b) ** 2)  # noqa: E731

        def f(x, y, w):
            weights = w if reduce in ("sum", "logsumexp") else None
            return mw.pairwise_reduce(
                fn, x, y, reduce=reduce, weights=weights, chunk_size=(chunk, chunk + 1)
            )

        def dense(x, y, w):
            s = jax.vmap(jax.vmap(fn, (None, 0)), (0, None))(x, y)
            if reduce == "sum":
                return jnp.sum(s * w[None], 1)
            if reduce == "logsumexp":
                return jax.nn.logsumexp(s + w[None], 1)
            return jnp.max(s, 1)

        return f, dense, args

    return build


def _attention(n, chunk, dtype):
    q, k, v = _inputs(dtype, (2, n, 4), (2, n + 1, 4), (2, n + 1, 3))

    def f(q, k, v):
        return mw.attention(q, k, v, chunk_size=(chunk, chunk + 1))

    def dense(q, k, v):
        s = jnp.einsum("bqd,bkd->bqk", q, k) / 2.0
        return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s, -1), v)

    return f, dense, (q, k, v)


def _dot_product_attention(floats=(), bias_lead=(1, 4), **options):
    """mw.dot_product_attention with ``options`` (layout (B, T, N, H), 4 query heads on 2
    K/V heads) against the dense reference; ``floats``: float options that are inputs
    too (their gradients are checked); ``bias_lead``: the bias's (B, N), N = 4 a bias per
    head (read heads-first), N = 1 one for every head (read with the heads inside the
    tiles). ``options`` may be a function of n."""

    def build(n, chunk, dtype):
        opts = options["of_n"](n) if "of_n" in options else options
        q, k, v, bias, sinks = _inputs(
            dtype, (2, n, 4, 4), (2, n + 1, 2, 4), (2, n + 1, 2, 3), bias_lead + (n, n + 1), (4,)
        )
        extra = {"bias": bias, "sinks": sinks}
        args = (q, k, v) + tuple(extra[name] for name in floats)

        def call(fn, **more):
            return lambda q, k, v, *xs: fn(q, k, v, **opts, **dict(zip(floats, xs)), **more)

        return (
            call(mw.dot_product_attention, chunk_size=(chunk, chunk + 1)),
            call(dense_attention),
            args,
        )

    return build


def _segments(n):
    # Segment 1 of the queries has no key (fully masked rows, the values' mean), and
    # segment 2 of the keys no query (an empty segment).
    q_seg = jnp.array([[i % 2 for i in range(n)], [0] * n])
    kv_seg = jnp.array([[0] * n + [2], [0] * (n + 1)])
    return {"q_segment_ids": q_seg, "kv_segment_ids": kv_seg, "is_causal": True}


def _scan(schedule):
    def build(n, chunk, dtype):
        args = _inputs(dtype, (n, 3), (3, 3))

        def step(w):
            return lambda h, x: (jnp.tanh(w @ h + x), jnp.sum(h))

        def f(xs, w):
            h, ys = mw.scan(
                step(w),
                jnp.zeros(3, xs.dtype),
                xs,
                schedule=schedule,
                checkpoints=chunk if schedule == "binomial" else None,
            )
            return jnp.concatenate([h, ys])

        def dense(xs, w):
            h, ys = jax.lax.scan(step(w), jnp.zeros(3, xs.dtype), xs)
            return jnp.concatenate([h, ys])

        return f, dense, args

    return build


def _coupling(w):
    """A RevNet additive coupling on (a, b) and its inverse (the ``inverse=`` rows)."""

    def step(c, x):
        a = c[0] + jnp.tanh(w @ c[1] + x)
        b = c[1] + jnp.tanh(w.T @ a)
        return (a, b), jnp.sum(a * b)

    def inverse(c, x):
        b = c[1] - jnp.tanh(w.T @ c[0])
        return (c[0] - jnp.tanh(w @ b + x), b)

    return step, inverse


def _scan_inverse(n, chunk, dtype):
    xs, w, b0 = _inputs(dtype, (n, 3), (3, 3), (3,))

    def f(xs, w, b0):
        step, inverse = _coupling(w)
        init = (jnp.zeros(3, xs.dtype), b0)
        (a, b), ys = mw.scan(step, init, xs, inverse=inverse, checkpoints=chunk)
        return jnp.concatenate([a, b, ys])

    def dense(xs, w, b0):
        (a, b), ys = jax.lax.scan(_coupling(w)[0], (jnp.zeros(3, xs.dtype), b0), xs)
        return jnp.concatenate([a, b, ys])

    return f, dense, (xs, w, b0)


def _while_loop(n, chunk, dtype, schedule="online"):
    (w,) = _inputs(dtype, (3, 3))
    h0 = jnp.ones(3, dtype) * 0.5

    def body(w):
        return lambda s: (jnp.tanh(w @ s[0] + 0.1), s[1] + 1)

    def f(w, h0):
        return mw.while_loop(
            lambda s: s[1] < n,
            body(w),
            (h0, 0),
            max_steps=n + 2,
            checkpoints=chunk,
            schedule=schedule,
        )[0]

    def dense(w, h0):
        h = h0
        for _ in range(n):
            h = jnp.tanh(w @ h + 0.1)
        return h

    return f, dense, (w, h0)


def _while_loop_buffers(zero_steps):
    """Write-only buffers: each row of ``out`` written twice (index i // 2, the later
    write wins), its last row and all of ``never`` never written."""

    def build(n, chunk, dtype):
        steps = 0 if zero_steps else n
        w, b0 = _inputs(dtype, (3, 3), ((n + 1) // 2 + 1, 3))
        h0 = jnp.ones(3, dtype) * 0.5

        def f(w, h0, b0):
            def body(s):
                i, h, out, never = s
                h = jnp.tanh(w @ h + 0.1)
                return i + 1, h, out.at[i // 2].set(h), never

            _, h, out, never = mw.while_loop(
                lambda s: s[0] < steps,
                body,
                (0, h0, b0, 2 * b0),
                max_steps=n + 2,
                checkpoints=chunk,
                buffers=lambda s: (s[2], s[3]),
            )
            return jnp.concatenate([h[None], out, never])

        def dense(w, h0, b0):
            h, out = h0, b0
            for i in range(steps):
                h = jnp.tanh(w @ h + 0.1)
                out = out.at[i // 2].set(h)
            return jnp.concatenate([h[None], out, 2 * b0])

        return f, dense, (w, h0, b0)

    return build


def _divergence(n, chunk, dtype, held=False):
    """``held``: ``chunk_size=None``, the cost matrix held for each solve."""
    x, y = _inputs(dtype, (n + 3, 2), (n + 4, 2))
    size = None if held else chunk + 1

    def f(x, y):
        return mw.ot.sinkhorn_divergence(
            x, y, epsilon=0.5, chunk_size=size, threshold=1e-6, max_iterations=2000
        )

    def dense(x, y):
        return mw.ot.sinkhorn_divergence(
            x, y, epsilon=0.5, chunk_size=10_000, threshold=1e-9, max_iterations=5000
        )

    return f, dense, (x, y)


def _ot_clouds(n, dtype):
    """n + 2 and n + 3 points with a duplicated point and a zero weight on each side."""
    x, y = _inputs(dtype, (n + 2, 2), (n + 3, 2))
    x, y = x.at[-1].set(x[0]), y.at[-1].set(y[0])
    a = jnp.linspace(1.0, 2.0, n + 2).at[1].set(0.0)
    b = jnp.linspace(2.0, 1.0, n + 3).at[1].set(0.0)
    return x, y, 1.3 * a / a.sum(), b / b.sum()


def _dense_unbalanced(x, y, a, b, cost, tau_a, tau_b, epsilon=0.5, iterations=400):
    """Dense OTT-convention (un)balanced Sinkhorn, differentiated through its iterations.

    ``f = tau_a T_b(g) - (1 - tau_a) eps log a`` (this package's potentials); the
    unrolled derivative of the converged loop is the exact one.
    """
    c = jax.vmap(jax.vmap(cost, (None, 0)), (0, None))(x, y)
    log_a = jnp.where(a > 0, jnp.log(jnp.where(a > 0, a, 1.0)), -jnp.inf)
    log_b = jnp.where(b > 0, jnp.log(jnp.where(b > 0, b, 1.0)), -jnp.inf)

    def update(tau, t, log_w):
        return tau * t - (1.0 - tau) * epsilon * jnp.where(jnp.isfinite(log_w), log_w, 0.0)

    def potentials(g):
        f = update(tau_a, -epsilon * jax.nn.logsumexp(log_b + (g - c) / epsilon, axis=1), log_a)
        t_a = -epsilon * jax.nn.logsumexp(log_a[:, None] + (f[:, None] - c) / epsilon, 0)
        return f, update(tau_b, t_a, log_b)

    g = jax.lax.fori_loop(0, iterations, lambda _, g: potentials(g)[1], jnp.zeros(len(y), c.dtype))
    f, _ = potentials(g)
    plan = a[:, None] * b[None] * jnp.exp((f[:, None] + g[None] - c) / epsilon)

    def mass_term(w, h, tau):
        if tau == 1.0:
            return w @ h
        rho = epsilon * tau / (1.0 - tau)
        return -rho * jnp.sum(w * jnp.expm1(-h / rho))

    reg = (
        mass_term(a, f, tau_a) + mass_term(b, g, tau_b) + epsilon * (a.sum() * b.sum() - plan.sum())
    )
    return reg, plan, f, g


def _unbalanced(tau_a, tau_b, cost, held=False):
    def build(n, chunk, dtype):
        x, y, a, b = _ot_clouds(n, dtype)
        size = None if held else chunk + 1
        mw_cost = cost if isinstance(cost, str) else cost
        dense_cost = mw.ot.costs.BUILTIN_COSTS[cost] if isinstance(cost, str) else cost

        def f(x, y):
            return mw.ot.sinkhorn(
                x, y, a.astype(x.dtype), b.astype(x.dtype), epsilon=0.5, cost=mw_cost,
                tau_a=tau_a, tau_b=tau_b, chunk_size=size, threshold=1e-7,
                max_iterations=3000,
            ).reg_ot_cost  # fmt: skip

        def dense(x, y):
            return _dense_unbalanced(
                x, y, a.astype(x.dtype), b.astype(x.dtype), dense_cost, tau_a, tau_b
            )[0]

        return f, dense, (x, y)

    return build


def _plan_operator(n, chunk, dtype):
    """apply (both axes), marginals, <P, C> and the entropic map of new points."""
    x, y, a, b = _ot_clouds(n, dtype)
    z, v = _inputs(dtype, (n + 1, 2), (n + 3,), seed=1)

    def f(x, y, z, v):
        out = mw.ot.sinkhorn(
            x, y, a.astype(x.dtype), b.astype(x.dtype), epsilon=0.5, tau_a=0.7, tau_b=0.5,
            chunk_size=chunk + 1, threshold=1e-7, max_iterations=3000,
        )  # fmt: skip
        w = out.apply(v, axis=1)
        return jnp.concatenate(
            [w, out.apply(w, axis=0), out.marginal(0), out.transport_cost()[None],
             out.transport(z).ravel()]
        )  # fmt: skip

    def dense(x, y, z, v):
        aa, bb = a.astype(x.dtype), b.astype(x.dtype)
        sq = mw.ot.costs.BUILTIN_COSTS["sqeuclidean"]
        _, plan, _, g = _dense_unbalanced(x, y, aa, bb, sq, 0.7, 0.5)
        c = jax.vmap(jax.vmap(sq, (None, 0)), (0, None))(x, y)
        cz = jax.vmap(jax.vmap(sq, (None, 0)), (0, None))(z, y)
        log_b = jnp.where(bb > 0, jnp.log(jnp.where(bb > 0, bb, 1.0)), -jnp.inf)
        weights = jax.nn.softmax(log_b + (g - cz) / 0.5, axis=1)
        w = plan @ v
        return jnp.concatenate(
            [w, plan.T @ w, plan.sum(0), jnp.sum(plan * c)[None], (weights @ y).ravel()]
        )

    return f, dense, (x, y, z, v)


def _dense_gromov(
    x, y, fx=None, fy=None, penalty=1.0, epsilon=2.0, outer=60, inner=400, taus=(1.0, 1.0)
):
    """Dense entropic (fused, unbalanced) Gromov-Wasserstein with uniform weights, OTT's
    conventions: linearise at the plan (first at ``a b^T``), solve that linear problem
    (log-domain Sinkhorn, relaxed as ``_dense_unbalanced``), repeat; unbalanced, each
    plan rescaled to the previous one's mass, epsilon times that mass and OTT's
    correction constant added to the cost (Sejourne, Vialard, Peyre 2021). The value is
    the last linear problem's ``reg_ot_cost`` and its gradient OTT's: the potentials
    (OTT's, ours plus ``eps log w``) and the plan held fixed (not the derivative of the
    value: the plan's own dependence on the points is dropped)."""
    n, m = x.shape[0], y.shape[0]
    a, b = jnp.full(n, 1.0 / n), jnp.full(m, 1.0 / m)
    log_a, log_b = jnp.log(a), jnp.log(b)
    relaxed = taus != (1.0, 1.0)

    def sq(u, v):
        return jnp.sum((u[:, None] - v[None]) ** 2, axis=-1)

    def linearised(x, y, fx, fy, plan, old_mass):
        """The cost at ``plan`` and its epsilon; unbalanced, the plan rescaled."""
        scale, eps, shift = 1.0, epsilon, 0.0
        if relaxed:
            scale = jnp.sqrt(old_mass / jax.lax.stop_gradient(plan.sum()))
            plan = plan * scale
            eps = epsilon * jax.lax.stop_gradient(plan.sum())
            shift = eps * jnp.sum(jax.scipy.special.xlogy(plan, plan))
            for tau, marginal, w in zip(taus, (plan.sum(1), plan.sum(0)), (a, b)):
                if tau < 1.0:
                    kl = jax.scipy.special.xlogy(marginal, marginal / w)
                    shift = shift + eps * tau / (1.0 - tau) * jnp.sum(kl)
        cx, cy = sq(x, x), sq(y, y)
        p, q = plan.sum(1), plan.sum(0)
        cost = (cx**2 @ p)[:, None] + (cy**2 @ q)[None] - 2 * cx @ plan @ cy + shift
        return (cost if fx is None else cost + penalty * scale * sq(fx, fy)), eps

    def solve(cost, eps):
        def update(tau, t, log_w):
            return tau * t - (1.0 - tau) * eps * log_w

        def step(fg, _):
            f, g = fg
            f = update(
                taus[0], -eps * jax.nn.logsumexp(log_b[None] + (g[None] - cost) / eps, 1), log_a
            )
            t = -eps * jax.nn.logsumexp(log_a[:, None] + (f[:, None] - cost) / eps, axis=0)
            return (f, update(taus[1], t, log_b)), None

        (f, g), _ = jax.lax.scan(step, (jnp.zeros(n), jnp.zeros(m)), None, length=inner)
        plan = jnp.exp(log_a[:, None] + log_b[None] + (f[:, None] + g[None] - cost) / eps)
        return f, g, plan

    def outer_step(carry, _):
        plan, old_mass = carry
        new = solve(*linearised(*held, plan, old_mass))[2]
        return (new, jax.lax.stop_gradient(plan.sum())), None

    held = jax.lax.stop_gradient((x, y, fx, fy))
    (plan, old_mass), _ = jax.lax.scan(
        outer_step, (jnp.exp(log_a[:, None] + log_b[None]), 1.0), None, length=outer
    )
    cost, eps = linearised(x, y, fx, fy, plan, old_mass)
    f, g, _ = solve(*jax.lax.stop_gradient((cost, eps)))
    # OTT's reg_ot_cost at its potentials f + eps log a, g + eps log b, held
    big_f, big_g = jax.lax.stop_gradient((f + eps * log_a, g + eps * log_b))
    f, g = big_f - eps * log_a, big_g - eps * log_b
    value = eps * (
        a.sum() * b.sum() - jnp.sum(jnp.exp((big_f[:, None] + big_g[None] - cost) / eps))
    )
    for tau, w, h in zip(taus, (a, b), (f, g)):
        rho = eps * tau / (1.0 - tau) if tau < 1.0 else None
        value = value + (w @ h if rho is None else -rho * jnp.sum(w * jnp.expm1(-h / rho)))
    return value


def _gromov(fused, taus=(1.0, 1.0)):
    """Entropic Gromov-Wasserstein (fused: with features; unbalanced: ``taus``) of clouds
    of ``n + 2`` and ``n + 3`` points, against the dense solver in float64."""

    outer = 60 if taus == (1.0, 1.0) else 200  # unbalanced, memwise stops after up to 97

    def build(n, chunk, dtype):
        x, y, fx, fy = _inputs(dtype, (n + 2, 2), (n + 3, 3), (n + 2, 2), (n + 3, 2), seed=2)
        # Each linear solve stops at a marginal error its working dtype reaches (float16
        # and bfloat16 are solved in float32): float32's rounding leaves it about 1e-7,
        # and at 1e-9 every unbalanced solve ran its 5,000 iterations (one row 113 s).
        # The float32 rows are held to 1e-4, so 1e-6 does not show in the comparison.
        inner = 1e-9 if dtype == jnp.float64 else 1e-6
        options = dict(
            epsilon=2.0, threshold=1e-9, min_iterations=20, max_iterations=200,
            sinkhorn_options=dict(threshold=inner, max_iterations=5000), chunk_size=chunk + 1,
            tau_a=taus[0], tau_b=taus[1],
        )  # fmt: skip

        if fused:

            def f(x, y, fx, fy):
                return mw.ot.gromov_wasserstein(
                    x, y, x_features=fx, y_features=fy, fused_penalty=0.5, **options
                ).reg_gw_cost

            def dense(x, y, fx, fy):
                return _dense_gromov(x, y, fx, fy, penalty=0.5, outer=outer, taus=taus)

            return f, dense, (x, y, fx, fy)

        def f(x, y):
            return mw.ot.gromov_wasserstein(x, y, **options).reg_gw_cost

        return f, lambda x, y: _dense_gromov(x, y, outer=outer, taus=taus), (x, y)

    return build


def _low_rank(cost, epsilon=0.0):
    """Low-rank Sinkhorn (rank 2) between clouds of ``n + 2`` and ``n + 3`` points from
    the same initial factors, against OTT-JAX's ``LRSinkhorn`` on the dense cost matrix
    in float64 (its gradient OTT's: the factors held fixed). The gradient is the plan's,
    first order in the factors: ``epsilon > 0`` makes them unique where the cost leaves
    optima nearly tied (a float32 solve of the user cost at epsilon 0 found a plan 2e-4
    from float64's)."""

    def build(n, chunk, dtype):
        from ott.geometry import geometry
        from ott.problems.linear import linear_problem
        from ott.solvers.linear import sinkhorn_lr

        x, y = _inputs(dtype, (n + 2, 2), (n + 3, 2), seed=3)
        rng = np.random.default_rng(0)
        q, r = rng.uniform(0.5, 1.0, (n + 2, 2)), rng.uniform(0.5, 1.0, (n + 3, 2))
        q, r = q / q.sum(1, keepdims=True) / (n + 2), r / r.sum(1, keepdims=True) / (n + 3)
        init = (q, r, np.array([0.5, 0.5]))
        options = dict(threshold=1e-10, max_iterations=3000, epsilon=epsilon)

        def f(x, y):
            return mw.ot.low_rank_sinkhorn(
                x, y, rank=2, cost=cost, init=init, chunk_size=chunk + 1, **options
            ).reg_ot_cost

        def dense(x, y):
            if cost == "sqeuclidean":
                c = jnp.sum((x[:, None] - y[None]) ** 2, -1)
            else:
                c = jax.vmap(lambda u: jax.vmap(lambda v: cost(u, v))(y))(x)
            problem = linear_problem.LinearProblem(geometry.Geometry(cost_matrix=c))
            solver = sinkhorn_lr.LRSinkhorn(2, **options)
            return solver(problem, init=tuple(jnp.asarray(v) for v in init)).reg_ot_cost

        return f, dense, (x, y)

    return build


def _linearize(n, chunk, dtype):
    w, v, x = _inputs(dtype, (3, 4), (4, 2), (n, 3))

    def net(p, x):
        return jnp.tanh(x @ p["w"]) @ p["v"]

    def f(w, v, x):
        lin = mw.linearize(net, {"w": w, "v": v})
        return lin({"w": w * 1.5, "v": v}, x)

    def dense(w, v, x):
        point = {"w": w, "v": v}
        out, tangent = jax.jvp(
            lambda p: net(p, x), (point,), ({"w": w * 0.5, "v": jnp.zeros_like(v)},)
        )
        return out + tangent

    return f, dense, (w, v, x)


def _dense_cross_entropy(x, w, b, labels, *, smoothing=0.0, cap=None, keep=None):
    logits = x @ w + b
    if cap is not None:
        logits = cap * jnp.tanh(logits / cap)
    logp = jax.nn.log_softmax(logits, -1)
    safe = jnp.where(labels >= 0, labels, 0)
    nll = -jnp.take_along_axis(logp, safe[:, None], 1)[:, 0]
    loss = (1 - smoothing) * nll - smoothing * jnp.mean(logp, -1)
    return loss if keep is None else jnp.where(keep, loss, 0.0)


def _cross_entropy(variant):
    """Per-token losses (bias, an ignored token, smoothing); the mean over a soft-capped
    tied head; or the mean with every token ignored. V = 2n + 3 is ragged for the tile."""

    def build(n, chunk, dtype):
        vocab = 2 * n + 3
        x, w, b = _inputs(dtype, (n, 4), (4, vocab), (vocab,))
        labels = (jnp.arange(n) * 7) % vocab
        if variant == "per_token" and n > 1:
            labels = labels.at[0].set(-100)
        if variant == "all_ignored":
            labels = jnp.full((n,), -100)
        keep = labels != -100
        opts = {"per_token": dict(smoothing=0.1), "capped_tied": dict(cap=2.0)}.get(variant, {})

        def f(x, w, b):
            tied = variant == "capped_tied"
            return mw.linear_cross_entropy(
                x,
                w.T if tied else w,
                labels,
                bias=b,
                layout="vd" if tied else "dv",
                ignore_index=-100,
                label_smoothing=opts.get("smoothing", 0.0),
                logit_soft_cap=opts.get("cap"),
                reduction="none" if variant == "per_token" else "mean",
                chunk_size=(chunk, chunk + 1),
            )

        def dense(x, w, b):
            loss = _dense_cross_entropy(x, w, b, labels, keep=keep, **opts)
            if variant == "per_token":
                return loss
            return jnp.sum(loss) / jnp.maximum(jnp.sum(keep), 1)

        return f, dense, (x, w, b)

    return build


CASES = {
    "chunked_map": Case(_chunked_map),
    "chunked_sum": Case(_chunked_sum),
    "pairwise_sum": Case(_pairwise("sum")),
    "pairwise_logsumexp": Case(_pairwise("logsumexp")),
    "pairwise_max": Case(_pairwise("max")),
    "attention": Case(_attention),
    "dpa_gqa": Case(_dot_product_attention(("bias",), is_causal=True)),
    "dpa_gqa_shared_bias": Case(_dot_product_attention(("bias",), bias_lead=(2, 1))),
    "dpa_segments": Case(_dot_product_attention(of_n=_segments)),
    "dpa_window_lengths": Case(
        _dot_product_attention(
            local_window_size=(1, 0),
            key_value_seq_lengths=jnp.array([0, 2]),  # batch 0 sees no key
            query_seq_lengths=jnp.array([1, 5]),
        )
    ),
    "dpa_softcap": Case(_dot_product_attention(logit_soft_cap=0.5)),
    "dpa_sinks": Case(_dot_product_attention(("sinks",), is_causal=True)),
    "dpa_dropout": Case(
        _dot_product_attention(dropout_rate=0.3, dropout_rng=jax.random.key(1), is_causal=True)
    ),
    "scan_binomial": Case(_scan("binomial")),
    "scan_nested": Case(_scan("nested"), forward_mode=True),
    "scan_inverse": Case(_scan_inverse),
    "while_loop": Case(_while_loop),
    # segments of `chunk` steps, two past the loop's end: the last steps pass through
    "while_loop_nested": Case(functools.partial(_while_loop, schedule="nested"), forward_mode=True),
    "while_loop_buffers": Case(_while_loop_buffers(zero_steps=False)),
    "while_loop_buffers_zero_steps": Case(_while_loop_buffers(zero_steps=True)),
    "sinkhorn_divergence": Case(_divergence, min_tolerance=1e-5),
    "sinkhorn_unbalanced": Case(_unbalanced(0.7, 0.5, "sqeuclidean"), min_tolerance=1e-5),
    "sinkhorn_semi_unbalanced_pnorm": Case(
        _unbalanced(1.0, 1e-3, mw.ot.PNormP(1.5)), min_tolerance=1e-5
    ),
    "sinkhorn_user_cost_tau_near_0": Case(
        _unbalanced(1e-3, 0.9, lambda u, v: jnp.sum(jnp.abs(u - v))), min_tolerance=1e-5
    ),
    "sinkhorn_held_cost_matrix": Case(
        _unbalanced(0.7, 0.5, "sqeuclidean", held=True), min_tolerance=1e-5
    ),
    "sinkhorn_divergence_held_cost_matrix": Case(
        functools.partial(_divergence, held=True), min_tolerance=1e-5
    ),
    "ot_plan_operator": Case(_plan_operator, min_tolerance=1e-5),
    "gromov_wasserstein": Case(_gromov(fused=False), min_tolerance=1e-5),
    "gromov_wasserstein_fused": Case(_gromov(fused=True), min_tolerance=1e-5),
    # (at tau (0.8, 0.6) OTT's outer loop cycles with period 3 on these clouds; at (0.9,
    # 0.7) it converges, in 68 to 97 iterations)
    "gromov_wasserstein_unbalanced": Case(_gromov(False, (0.9, 0.7)), min_tolerance=1e-5),
    # (at tau_b 0.5 its outer loop creeps: float32 stops it at equal costs 1e-3 from the
    # fixed point on the chunk>n clouds)
    "gromov_wasserstein_fused_semi_unbalanced": Case(_gromov(True, (1.0, 0.9)), min_tolerance=1e-5),
    "low_rank_sinkhorn": Case(_low_rank("sqeuclidean"), min_tolerance=1e-5),
    "low_rank_sinkhorn_user_cost": Case(
        _low_rank(lambda u, v: jnp.sum(jnp.abs(u - v) ** 1.5), epsilon=0.1), min_tolerance=1e-5
    ),
    "linearize": Case(_linearize),
    "cross_entropy": Case(_cross_entropy("per_token")),
    "cross_entropy_capped_tied": Case(_cross_entropy("capped_tied")),
    "cross_entropy_all_ignored": Case(_cross_entropy("all_ignored")),
}


def _close(actual, expected, dtype_name, what, min_tolerance=0.0):
    tolerance = max(TOLERANCE["matrix"][dtype_name], min_tolerance)
    assert_close(jnp.asarray(actual, jnp.float64), expected, tolerance, what, scale_floor=1.0)


def _upcast(args):
    return tuple(jnp.asarray(a, jnp.float64) for a in args)


TRANSFORMS = ("eager", "jit", "vmap", "grad", "value_and_grad", "jacrev", "checkpoint", "jvp")


def _run(case_name, shape_name, dtype_name, transform):
    case = CASES[case_name]
    n, chunk = SHAPES[shape_name]
    dtype = DTYPES[dtype_name]
    f, dense, args = case.build(n, chunk, dtype)
    ref_args = _upcast(args)
    close = functools.partial(_close, min_tolerance=case.min_tolerance)

    def loss_of(fn):
        return lambda *a: jnp.sum(jnp.asarray(fn(*a)).astype(jnp.float64) ** 2)

    # The dense references run compiled (eagerly, a float64 Sinkhorn's gradient took
    # most of a row's time); memwise runs under the row's own transformation.
    if transform in ("eager", "jit"):
        out = (f if transform == "eager" else jax.jit(f))(*args)
        assert jnp.asarray(out).dtype == dtype, (jnp.asarray(out).dtype, dtype)
        close(out, jax.jit(dense)(*ref_args), dtype_name, "value")
    elif transform == "vmap":
        batched = tuple(jnp.stack([a, a * 0.5]) for a in args)
        out = jax.vmap(f)(*batched)
        expected = jax.jit(jax.vmap(dense))(*_upcast(batched))
        close(out, expected, dtype_name, "vmap value")
    elif transform in ("grad", "jit_grad", "value_and_grad", "checkpoint"):
        argnums = tuple(range(len(args)))
        loss = loss_of(f)
        if transform == "checkpoint":
            loss = jax.checkpoint(loss)
        if transform == "value_and_grad":
            value, grads = jax.value_and_grad(loss, argnums)(*args)
            close(value, jax.jit(loss_of(dense))(*ref_args), dtype_name, "value")
        elif transform == "jit_grad":
            grads = jax.jit(jax.grad(loss, argnums))(*args)
        else:
            grads = jax.grad(loss, argnums)(*args)
        expected = jax.jit(jax.grad(loss_of(dense), argnums))(*ref_args)
        for i, (g, e) in enumerate(zip(grads, expected)):
            assert g.dtype == dtype, (i, g.dtype)
            close(g, e, dtype_name, f"gradient of argument {i}")
    elif transform == "jacrev":
        jac = jax.jacrev(f)(*args)
        expected = jax.jit(jax.jacrev(dense))(*ref_args)
        close(jac, expected, dtype_name, "jacrev")
    elif transform == "jvp":
        tangents = tuple(jnp.ones_like(a) for a in args)
        if not case.forward_mode:
            with pytest.raises(TypeError):
                jax.jvp(f, args, tangents)
            return
        out, tangent = jax.jvp(f, args, tangents)
        _, expected = jax.jit(lambda p, t: jax.jvp(dense, p, t))(ref_args, _upcast(tangents))
        close(tangent, expected, dtype_name, "jvp tangent")


# Every transformation on a ragged shape in float32 (un-jitted where it is not jit);
# every edge shape eagerly and its gradient compiled; every other dtype compiled, value
# and gradient. Their numerics do not depend on the transformation, and an un-jitted
# gradient compiles a program for each primitive it dispatches (28 a row; these rows
# took half the matrix's time).
PARAMS = sorted(
    {(c, "ragged", "float32", t) for c in CASES for t in TRANSFORMS}
    | {(c, s, "float32", t) for c in CASES for s in SHAPES for t in ("eager", "jit_grad")}
    | {
        (c, "ragged", d, t)
        for c in CASES
        for d in ("float64", "bfloat16", "float16")
        for t in ("jit", "jit_grad")
    }
)
PARAMS = [pytest.param(*p, id="-".join(p)) for p in PARAMS]


# The stratified minimum of the 756 rows (41 to 43 by the seed: every primitive, shape,
# dtype and transformation at least once; 5.5% is below it, so the minimum decides),
# every row under `make test-full`. A row's time is its compilations: measured, an
# un-jitted transformation compiles 30 to 90 programs (each primitive it dispatches) and
# a compiled row 8 to 17 (inputs, the float64 reference, memwise's program); the sizes
# are already the smallest that hold each edge. 15% (95 rows) took 511 s of the
# contended suite, 8% (61 rows) about 150 s.
@pytest.mark.grid(fraction=0.055)
@pytest.mark.parametrize("case_name, shape_name, dtype_name, transform", PARAMS)
@pytest.mark.slow
def test_matrix(case_name, shape_name, dtype_name, transform):
    _run(case_name, shape_name, dtype_name, transform)


# --------------------------------------------------------------------------------------
# Closures over integers traced by an enclosing transformation.
#
# The function given to a primitive reads an integer ``k`` that an enclosing loop,
# branch, checkpoint or jit traces (nested loops whose inner bound is the outer
# counter; a solver loop that carries its step count). Each row is ``(memwise,
# reference)``, both ``(w, k) -> array`` with ``w`` a float32 vector and ``k`` an int32
# scalar; the reference is the plain-JAX computation (``lax.scan``, a masked scan for
# the while loop, dense maps and reductions, ``jax.jvp``, a dense Sinkhorn), evaluated
# in float64 under the same enclosing transformation.

_XS = jnp.linspace(-1.0, 1.0, 15).reshape(5, 3)
_YS = jnp.linspace(-0.5, 1.5, 12).reshape(4, 3)


def _closure_scan(w, k):
    step = lambda h, x: (jnp.tanh(w * h + x) + 0.1 * k, h * k)  # noqa: E731
    return step, jnp.zeros(3, w.dtype), _XS.astype(w.dtype)


def _closure_scan_carried(w, k):
    # k is a carry leaf the body returns unchanged (a loop constant).
    step = lambda c, x: ((jnp.tanh(w * c[0] + x) * c[1], c[1]), c[0])  # noqa: E731
    return step, (jnp.zeros(3, w.dtype), k), _XS.astype(w.dtype)


def _closure_scan_inverse(w, k):
    # the int k enters the step and its inverse; the carry is rebuilt, not kept
    step = lambda c, x: (c + jnp.sin(w * x) * k, c * k)  # noqa: E731
    inverse = lambda c, x: c - jnp.sin(w * x) * k  # noqa: E731
    return step, jnp.ones(3, w.dtype), _XS.astype(w.dtype), inverse


def _closure_while(carried):
    """A loop of k + 1 steps whose bound (and a term of the body) is the integer k; with
    ``carried``, k travels in the carry unchanged, as a solver's ``max_steps`` does."""

    def parts(w, k):
        def body(s):
            h, i = s[0], s[1]
            bound = s[2] if carried else k
            return (jnp.tanh(w * h) + 0.1 * bound, i + 1) + ((s[2],) if carried else ())

        def cond(s):
            return s[1] < (s[2] if carried else k) + 1

        init = (jnp.ones(3, w.dtype), jnp.int32(0)) + ((k,) if carried else ())
        return cond, body, init

    def memwise(w, k):
        cond, body, init = parts(w, k)
        return mw.while_loop(cond, body, init, max_steps=8, checkpoints=2)[0]

    def reference(w, k):  # the same steps as a scan of max_steps, masked past the bound
        cond, body, init = parts(w, k)
        step = lambda s, _: (jax.tree.map(functools.partial(jnp.where, cond(s)), body(s), s), None)  # noqa: E731
        return jax.lax.scan(step, init, None, length=8)[0][0]

    return memwise, reference


def _dense_reg_cost(cost, x, y, epsilon=0.5, iterations=300):
    """Dense log-domain Sinkhorn between uniform clouds, envelope gradient by autodiff."""
    c = jax.vmap(jax.vmap(cost, (None, 0)), (0, None))(x, y)
    c0 = jax.lax.stop_gradient(c)
    log_a, log_b = -jnp.log(len(x)) * jnp.ones(len(x)), -jnp.log(len(y)) * jnp.ones(len(y))

    def step(g, _):
        f = -epsilon * jax.nn.logsumexp(log_b + (g - c0) / epsilon, axis=1)
        return -epsilon * jax.nn.logsumexp(log_a[:, None] + (f[:, None] - c0) / epsilon, 0), None

    g = jax.lax.scan(step, jnp.zeros(len(y), c.dtype), None, length=iterations)[0]
    f = -epsilon * jax.nn.logsumexp(log_b + (g - c0) / epsilon, axis=1)
    f, g = jax.lax.stop_gradient((f, g))
    a, b = jnp.exp(log_a), jnp.exp(log_b)
    plan = a[:, None] * b[None] * jnp.exp((f[:, None] + g[None] - c) / epsilon)
    return a @ f + b @ g + epsilon * (1.0 - plan.sum())


def _lin_net(k):
    return lambda p, x: jnp.tanh(x * p).sum(-1) * k


def _ntk_net(k):
    return lambda p, x: jnp.tanh(x * p) * k


def _dense_ntk(net, p, xs):
    jac = jax.jacobian(lambda p: net(p, xs))(p)  # (n, out, params)
    return jnp.einsum("iap,jbp->ijab", jac, jac)


def _ot_cost(w, k):
    return lambda u, v: jnp.sum((u - v * w) ** 2) / k


CLOSURE_PRIMITIVES = {
    "scan": (
        lambda w, k: jnp.concatenate(mw.scan(*_closure_scan(w, k), checkpoints=2)[1]),
        lambda w, k: jnp.concatenate(jax.lax.scan(*_closure_scan(w, k))[1]),
    ),
    "scan_carried_int": (
        lambda w, k: mw.scan(*_closure_scan_carried(w, k), checkpoints=2)[1].ravel(),
        lambda w, k: jax.lax.scan(*_closure_scan_carried(w, k))[1].ravel(),
    ),
    "scan_inverse": (
        lambda w, k: jnp.concatenate(
            mw.scan(*_closure_scan_inverse(w, k)[:3], inverse=_closure_scan_inverse(w, k)[3])[1]
        ),
        lambda w, k: jnp.concatenate(jax.lax.scan(*_closure_scan_inverse(w, k)[:3])[1]),
    ),
    "while_loop": _closure_while(carried=False),
    "while_loop_carried_int": _closure_while(carried=True),
    "chunked_map": (
        lambda w, k: mw.chunked_map(
            lambda x: jnp.sin(w * x) + k, _XS.astype(w.dtype), chunk_size=2
        ),
        lambda w, k: jnp.sin(w * _XS.astype(w.dtype)) + k,
    ),
    "chunked_sum": (
        lambda w, k: mw.chunked_sum(
            lambda x: jnp.sin(w * x) * k, _XS.astype(w.dtype), chunk_size=2
        ),
        lambda w, k: jnp.sum(jnp.sin(w * _XS.astype(w.dtype)) * k, 0),
    ),
    "pairwise_reduce": (
        lambda w, k: mw.pairwise_reduce(
            lambda a, b: -jnp.sum((a - b * w) ** 2) / k,
            _XS.astype(w.dtype),
            _YS.astype(w.dtype),
            reduce="logsumexp",
            chunk_size=(2, 3),
        ),
        lambda w, k: jax.nn.logsumexp(
            -jnp.sum((_XS[:, None].astype(w.dtype) - _YS[None].astype(w.dtype) * w) ** 2, -1) / k,
            1,
        ),
    ),
    "linearize": (
        lambda w, k: mw.linearize(_lin_net(k), w)(1.5 * w, _XS.astype(w.dtype)),
        lambda w, k: sum(jax.jvp(lambda p: _lin_net(k)(p, _XS.astype(w.dtype)), (w,), (0.5 * w,))),
    ),
    "ntk_empirical": (
        lambda w, k: mw.ntk.empirical(_ntk_net(k), w, _XS.astype(w.dtype), chunk_size=2),
        lambda w, k: _dense_ntk(_ntk_net(k), w, _XS.astype(w.dtype)),
    ),
    "sinkhorn": (
        lambda w, k: (
            mw.ot.sinkhorn(
                _XS.astype(w.dtype),
                _YS.astype(w.dtype),
                epsilon=0.5,
                cost=_ot_cost(w, k),
                chunk_size=3,
                threshold=1e-7,
            ).reg_ot_cost
        ),
        lambda w, k: _dense_reg_cost(_ot_cost(w, k), _XS.astype(w.dtype), _YS.astype(w.dtype)),
    ),
}


def _sq(prim):
    return lambda w, k: jnp.sum(jnp.asarray(prim(w, k), jnp.float64) ** 2)


# Each ``(prim, w) -> loss`` calls prim with an int32 k traced by the named enclosing
# transformation (k = 1 and 2 where it loops).
ENCLOSING = {
    "scan": lambda prim, w: jax.lax.scan(
        lambda acc, k: (acc + _sq(prim)(w, k), None), 0.0, jnp.arange(1, 3, dtype=jnp.int32)
    )[0],
    "fori_loop": lambda prim, w: jax.lax.fori_loop(
        1, 3, lambda k, acc: acc + _sq(prim)(w, k), jnp.float64(0.0)
    ),
    "map": lambda prim, w: jax.lax.map(
        lambda k: _sq(prim)(w, k), jnp.arange(1, 3, dtype=jnp.int32)
    ).sum(),
    "vmap": lambda prim, w: jax.vmap(lambda k: _sq(prim)(w, k))(
        jnp.arange(1, 3, dtype=jnp.int32)
    ).sum(),
    "cond": lambda prim, w: jax.lax.cond(
        jnp.sum(w) < 100.0,
        _sq(prim),
        lambda w, k: jnp.sum(w * 0.0, dtype=jnp.float64),
        w,
        jnp.int32(2),
    ),
    "switch": lambda prim, w: jax.lax.switch(
        jnp.int32(1), [_sq(prim), lambda w, k: _sq(prim)(w, k + 1)], w, jnp.int32(1)
    ),
    "checkpoint": lambda prim, w: jax.checkpoint(_sq(prim))(w, jnp.int32(2)),
    "jit": lambda prim, w: jax.jit(_sq(prim))(w, jnp.int32(2)),
}


# A primitive x enclosing-transformation grid (88 cases): a stratified sample runs every
# primitive and every enclosing transformation at least once (tests/_grid.py).
@pytest.mark.grid(fraction=0.15)
@pytest.mark.parametrize("enclosing", sorted(ENCLOSING))
@pytest.mark.parametrize("primitive", sorted(CLOSURE_PRIMITIVES))
@pytest.mark.slow
def test_closes_over_an_int_traced_by_an_enclosing_transformation(primitive, enclosing):
    ours, reference = CLOSURE_PRIMITIVES[primitive]
    wrap = ENCLOSING[enclosing]
    w = jnp.array([0.7, -0.4, 1.1], jnp.float32)
    value, grad = jax.value_and_grad(lambda w: wrap(ours, w))(w)
    # the reference compiled (eager, each of its operations compiled alone)
    expected, expected_grad = jax.jit(jax.value_and_grad(lambda w: wrap(reference, w)))(
        w.astype(jnp.float64)
    )
    assert grad.dtype == jnp.float32
    _close(value, expected, "float32", "value", min_tolerance=1e-5)
    _close(grad, expected_grad, "float32", "gradient", min_tolerance=1e-5)


def test_int_traced_by_a_jit_under_grad_matches_lax_scan():
    """A body that reads an int traced by an enclosing jit, that jit under grad."""

    def loss(scan, w, n):
        return scan(lambda h, x: (jnp.sin(w * h) + n * 2, None), jnp.ones(2), None, length=5)[
            0
        ].sum()

    ours = jax.grad(jax.jit(functools.partial(loss, mw.scan)))(0.7, 2)
    expected = jax.grad(jax.jit(functools.partial(loss, jax.lax.scan)))(0.7, 2)
    assert_close(ours, expected, 1e-6, "gradient")


# --------------------------------------------------------------------------------------
# Bad input: a memwise TypeError/ValueError that names the argument, never a raw JAX
# traceback.

_X = jnp.ones((4, 2))
_K = jnp.ones((2, 5, 4))
_Q = jnp.ones((2, 5, 2, 4))  # (B, T, N, H)
_PAIR = lambda a, b: jnp.sum(a * b)  # noqa: E731
_STEP = lambda h, x: (h + x, None)  # noqa: E731

BAD_INPUTS = {
    "chunked_map f": (lambda: mw.chunked_map(3, _X, chunk_size=2), TypeError, "f"),
    "chunked_map chunk_size": (
        lambda: mw.chunked_map(jnp.sin, _X, chunk_size=0),
        ValueError,
        "chunk_size",
    ),
    "chunked_map chunk_size tuple": (
        lambda: mw.chunked_map(jnp.sin, _X, chunk_size=(2, 2)),
        TypeError,
        "chunk_size",
    ),
    "chunked_sum xs scalar": (
        lambda: mw.chunked_sum(jnp.sin, jnp.ones(()), chunk_size=2),
        ValueError,
        "xs",
    ),
    "pairwise fn": (lambda: mw.pairwise_reduce(None, _X, _X), TypeError, "fn"),
    "pairwise reduce": (
        lambda: mw.pairwise_reduce(_PAIR, _X, _X, reduce="mean"),
        ValueError,
        "reduce",
    ),
    "pairwise axis": (lambda: mw.pairwise_reduce(_PAIR, _X, _X, axis=2), ValueError, "axis"),
    "pairwise weights": (
        lambda: mw.pairwise_reduce(_PAIR, _X, _X, weights=jnp.ones(3)),
        ValueError,
        "weights",
    ),
    "pairwise chunk_size": (
        lambda: mw.pairwise_reduce(_PAIR, _X, _X, chunk_size="big"),
        ValueError,
        "chunk_size",
    ),
    # Non-arrays among the data: the primitive's own argument, not "not a valid JAX type".
    "chunked_map xs string": (
        lambda: mw.chunked_map(jnp.sin, "abc", chunk_size=2),
        TypeError,
        "xs must be an array, got 'abc' (type str)",
    ),
    "chunked_sum xs object leaf": (
        lambda: mw.chunked_sum(jnp.sin, {"a": _X, "b": object()}, chunk_size=2),
        TypeError,
        "xs['b'] must be an array",
    ),
    "chunked_map xs string array": (
        lambda: mw.chunked_map(len, np.array(["ab", "cd"]), chunk_size=2),
        TypeError,
        "(type ndarray, dtype <U2)",
    ),
    "pairwise x string": (
        lambda: mw.pairwise_reduce(_PAIR, "abc", _X),
        TypeError,
        "x must be an array, got 'abc' (type str)",
    ),
    "pairwise y object": (
        lambda: mw.pairwise_reduce(_PAIR, _X, object()),
        TypeError,
        "(type object)",
    ),
    "pairwise weights string": (
        lambda: mw.pairwise_reduce(_PAIR, _X, _X, weights="abc"),
        TypeError,
        "weights must be an array, got 'abc'",
    ),
    "while_loop init string": (
        lambda: mw.while_loop(lambda s: s < 3, lambda s: s + 1, "abc", max_steps=3),
        TypeError,
        "init must be an array, got 'abc' (type str)",
    ),
    "while_loop init object leaf": (
        lambda: mw.while_loop(lambda s: True, lambda s: s, (0.0, object()), checkpoints=2),
        TypeError,
        "init[1] must be an array",
    ),
    "scan init string": (
        lambda: mw.scan(_STEP, "abc", _X),
        TypeError,
        "init must be an array, got 'abc' (type str)",
    ),
    "attention shapes": (lambda: mw.attention(_K, _K[:, :, :3], _K), ValueError, "feature dim"),
    "attention string q": (lambda: mw.attention("q", _K, _K), TypeError, "q must be an array"),
    "attention string bias": (
        lambda: mw.attention(_K, _K, _K, bias="0"),
        TypeError,
        "bias must be an array",
    ),
    "attention string scale": (
        lambda: mw.attention(_K, _K, _K, scale="0.1"),
        TypeError,
        "scale must be a real scalar",
    ),
    "attention list scale": (lambda: mw.attention(_K, _K, _K, scale=[1.0]), TypeError, "scale"),
    "dpa string query": (
        lambda: mw.dot_product_attention("q", _Q, _Q),
        TypeError,
        "query must be an array",
    ),
    "dpa heads do not divide": (
        lambda: mw.dot_product_attention(jnp.ones((2, 5, 3, 4), _Q.dtype), _Q, _Q),
        ValueError,
        "multiple of the number of key/value heads",
    ),
    "dpa mismatched lengths": (
        lambda: mw.dot_product_attention(_Q, _Q, _Q[:, :4]),
        ValueError,
        "value must have key's",
    ),
    "dpa float mask": (
        lambda: mw.dot_product_attention(_Q, _Q, _Q, mask=jnp.ones((5, 5))),
        TypeError,
        "pass additive masks",
    ),
    "dpa mask shape": (
        lambda: mw.dot_product_attention(_Q, _Q, _Q, mask=jnp.ones((3, 5), bool)),
        ValueError,
        "mask of shape",
    ),
    "dpa float lengths": (
        lambda: mw.dot_product_attention(_Q, _Q, _Q, query_seq_lengths=jnp.ones(2)),
        TypeError,
        "query_seq_lengths must be an integer array",
    ),
    "dpa lengths shape": (
        lambda: mw.dot_product_attention(_Q, _Q, _Q, key_value_seq_lengths=jnp.ones(3, int)),
        ValueError,
        "key_value_seq_lengths must have shape",
    ),
    "dpa segment length": (
        lambda: mw.dot_product_attention(_Q, _Q, _Q, q_segment_ids=jnp.zeros((2, 4), int)),
        ValueError,
        "q_segment_ids must have shape",
    ),
    "dpa float segments": (
        lambda: mw.dot_product_attention(_Q, _Q, _Q, q_segment_ids=jnp.zeros((2, 5))),
        TypeError,
        "q_segment_ids must be an integer array",
    ),
    "dpa one segment array, lengths differ": (
        lambda: mw.dot_product_attention(_Q, _Q[:, :4], _Q[:, :4], q_segment_ids=jnp.zeros(5, int)),
        ValueError,
        "kv_segment_ids",
    ),
    "dpa cudnn": (
        lambda: mw.dot_product_attention(_Q, _Q, _Q, implementation="cudnn"),
        ValueError,
        "jax.nn.dot_product_attention(..., implementation='cudnn')",
    ),
    "dpa dropout without key": (
        lambda: mw.dot_product_attention(_Q, _Q, _Q, dropout_rate=0.1),
        ValueError,
        "dropout_rng",
    ),
    "dpa dropout rate": (
        lambda: mw.dot_product_attention(
            _Q, _Q, _Q, dropout_rate=1.0, dropout_rng=jax.random.key(0)
        ),
        ValueError,
        "dropout_rate must be in [0, 1)",
    ),
    "dpa sinks shape": (
        lambda: mw.dot_product_attention(_Q, _Q, _Q, sinks=jnp.zeros(3)),
        TypeError,
        "sinks must be a float array of shape (N,)",
    ),
    "dpa soft cap": (
        lambda: mw.dot_product_attention(_Q, _Q, _Q, logit_soft_cap=-1.0),
        ValueError,
        "logit_soft_cap",
    ),
    "dpa window": (
        lambda: mw.dot_product_attention(_Q, _Q, _Q, local_window_size=(2, -1)),
        ValueError,
        "local_window_size",
    ),
    "dpa traced causal": (
        lambda: jax.jit(lambda c: mw.dot_product_attention(_Q, _Q, _Q, is_causal=c))(True),
        TypeError,
        "static argument",
    ),
    "attention float mask": (
        lambda: mw.attention(_K, _K, _K, mask=jnp.zeros((5, 5))),
        TypeError,
        "mask",
    ),
    "attention int q": (lambda: mw.attention(_K.astype(int), _K, _K), TypeError, "q, k, v"),
    "attention string causal": (
        lambda: mw.attention(_K, _K, _K, causal="yes"),
        TypeError,
        "causal",
    ),
    "attention traced causal": (
        lambda: jax.jit(lambda c: mw.attention(_K, _K, _K, causal=c))(True),
        TypeError,
        "causal",
    ),
    "divergence return_results": (
        lambda: mw.ot.sinkhorn_divergence(_K[0], _K[0], return_results="yes"),
        TypeError,
        "return_results",
    ),
    "accumulate_grad int params": (
        lambda: mw.accumulate_grad(
            lambda p, b: jnp.mean(b @ p["w"]) * p["i"],
            {"w": jnp.ones(5), "i": jnp.int32(3)},
            jnp.ones((4, 5)),
            microbatches=2,
        ),
        TypeError,
        "params['i']",
    ),
    "scan f": (lambda: mw.scan(None, 0.0, _X), TypeError, "f"),
    "scan checkpoints": (
        lambda: mw.scan(_STEP, jnp.zeros(2), _X, checkpoints=0),
        ValueError,
        "checkpoints",
    ),
    "scan schedule": (
        lambda: mw.scan(_STEP, jnp.zeros(2), _X, schedule="fast"),
        ValueError,
        "schedule",
    ),
    "scan carry dtype": (
        lambda: mw.scan(lambda h, x: (h.astype(int), None), jnp.zeros(2), _X),
        TypeError,
        "carry",
    ),
    "scan Python float carry returned as int32": (
        lambda: mw.scan(lambda h, x: (h.astype(jnp.int32), None), 0.0, _X),
        TypeError,
        "changed the type of the carry: init is float64[] (weakly typed",
    ),
    "scan inverse not callable": (
        lambda: mw.scan(_STEP, jnp.zeros(2), _X, inverse="h - x"),
        TypeError,
        "inverse must be callable",
    ),
    "scan inverse returns a pair": (
        lambda: mw.scan(_STEP, jnp.zeros(2), _X, inverse=lambda h, x: (h - x, None)),
        TypeError,
        "inverse must return the carry before the step, structured as init",
    ),
    "scan inverse changes the dtype": (
        lambda: mw.scan(_STEP, jnp.zeros(2), _X, inverse=lambda h, x: (h - x).astype(int)),
        TypeError,
        "inverse changed the type of the carry",
    ),
    "scan drift without inverse": (
        lambda: mw.scan(_STEP, jnp.zeros(2), _X, drift=mw.DriftLog()),
        ValueError,
        "drift= records how far the carries rebuilt by inverse= drift",
    ),
    "scan carry leaf path": (
        lambda: mw.scan(
            lambda c, x: ({"h": c["h"] + x, "n": c["n"] + 0.5}, None),
            {"h": jnp.zeros(2), "n": jnp.int32(0)},
            _X,
        ),
        TypeError,
        "carry['n']: init is int32[] but f returned float64[]",
    ),
    "while_loop Python float carry returned as int32": (
        lambda: mw.while_loop(
            lambda s: s < 3, lambda s: (s + 1).astype(jnp.int32), 0.0, max_steps=5
        ),
        TypeError,
        "body_fun changed the type of the carry",
    ),
    "while_loop max_steps": (
        lambda: mw.while_loop(lambda s: s < 3, lambda s: s + 1, 0.0, max_steps=0),
        ValueError,
        "max_steps",
    ),
    "while_loop buffer read": (
        lambda: mw.while_loop(
            lambda s: s[0] < 3,
            lambda s: (s[0] + 1, s[1].at[s[0]].set(s[1][0] + 1.0)),
            (0, jnp.zeros(3)),
            max_steps=3,
            buffers=lambda s: s[1],
        ),
        TypeError,
        "write-only inside the loop: buffer[0] would need its values",
    ),
    "while_loop buffer read in cond": (
        lambda: mw.while_loop(
            lambda s: s[1].sum() < 3,
            lambda s: (s[0] + 1, s[1].at[s[0]].set(1.0)),
            (0, jnp.zeros(3)),
            max_steps=3,
            buffers=lambda s: s[1],
        ),
        TypeError,
        "write-only inside the loop",
    ),
    "while_loop buffer write out of range": (
        lambda: mw.while_loop(
            lambda s: s[0] < 3,
            lambda s: (s[0] + 1, s[1].at[3].set(1.0)),
            (0, jnp.zeros(3)),
            max_steps=3,
            buffers=lambda s: s[1],
        ),
        IndexError,
        "index 3 is out of range for axis 0 of the buffer [3]",
    ),
    "while_loop buffer write shape": (
        lambda: mw.while_loop(
            lambda s: s[0] < 3,
            lambda s: (s[0] + 1, s[1].at[s[0]].set(jnp.ones(2))),
            (0, jnp.zeros((3, 4))),
            max_steps=3,
            buffers=lambda s: s[1],
        ),
        ValueError,
        "does not broadcast to the written part [4]",
    ),
    "while_loop buffer replaced": (
        lambda: mw.while_loop(
            lambda s: s[0] < 3,
            lambda s: (s[0] + 1, jnp.zeros(3)),
            (0, jnp.zeros(3)),
            max_steps=3,
            buffers=lambda s: s[1],
        ),
        TypeError,
        "must return each buffer it was given",
    ),
    "while_loop buffers not callable": (
        lambda: mw.while_loop(
            lambda s: s[0] < 3, lambda s: s, (0, jnp.zeros(3)), max_steps=3, buffers=1
        ),
        TypeError,
        "buffers must be None or a callable",
    ),
    "while_loop buffers not of the carry": (
        lambda: mw.while_loop(
            lambda s: s[0] < 3,
            lambda s: s,
            (0, jnp.zeros(3)),
            max_steps=3,
            buffers=lambda s: jnp.zeros(3),
        ),
        ValueError,
        "buffers(carry) must return leaves of the carry",
    ),
    "while_loop cond": (
        lambda: mw.while_loop(lambda s: s, lambda s: s + 1, 0.0, max_steps=3),
        TypeError,
        "cond_fun",
    ),
    "ot weights": (lambda: mw.ot.sinkhorn(_X, _X, a=jnp.ones(3)), ValueError, "a"),
    "ot unbalanced": (
        lambda: mw.ot.sinkhorn(_X, _X, a=jnp.ones(4), b=3 * jnp.ones(4)),
        ValueError,
        "sum(a)",
    ),
    "ot cost": (lambda: mw.ot.sinkhorn(_X, _X, cost="manhattan"), ValueError, "cost"),
    "ot tau above 1": (lambda: mw.ot.sinkhorn(_X, _X, tau_a=1.5), ValueError, "tau_a"),
    "ot tau 0": (lambda: mw.ot.sinkhorn_divergence(_X, _X, tau_b=0.0), ValueError, "tau_b"),
    "ot reach and tau": (
        lambda: mw.ot.sinkhorn(_X, _X, tau_a=0.5, reach=1.0),
        ValueError,
        "either reach",
    ),
    "ot negative weights unbalanced": (
        lambda: mw.ot.sinkhorn(_X, _X, a=-jnp.ones(4), tau_a=0.5),
        ValueError,
        "negative",
    ),
    "ot mismatched dims unbalanced": (
        lambda: mw.ot.sinkhorn(_X, jnp.ones((3, 5)), tau_b=0.5),
        ValueError,
        "same dimension",
    ),
    "ot non-scalar cost": (
        lambda: mw.ot.sinkhorn(_X, _X, cost=lambda u, v: u * v),
        TypeError,
        "scalar",
    ),
    "ot cost of one point": (
        lambda: mw.ot.sinkhorn(_X, _X, cost=lambda u: jnp.sum(u)),
        TypeError,
        "function of two points",
    ),
    "ot min_iterations": (
        lambda: mw.ot.sinkhorn(_X, _X, min_iterations=-1),
        ValueError,
        "min_iterations",
    ),
    "ot cost_gradient": (
        lambda: mw.ot.sinkhorn(_X, _X, cost_gradient="danskin"),
        ValueError,
        "cost_gradient",
    ),
    "ot plan axis": (
        lambda: mw.ot.sinkhorn(_X, _X, epsilon=1.0).apply(jnp.ones(4), axis=3),
        ValueError,
        "axis",
    ),
    "ot string x": (lambda: mw.ot.sinkhorn("abc", _X), TypeError, "x must be"),
    "ot string weights": (lambda: mw.ot.sinkhorn(_X, _X, b="abc"), TypeError, "b must be"),
    "ot string epsilon": (lambda: mw.ot.sinkhorn(_X, _X, epsilon="0.1"), TypeError, "epsilon"),
    "fit int in a slice": (
        lambda: jax.grad(mw.fit(lambda x, n: jnp.sum(x[:n]), budget="1MiB"))(_X, 2),
        TypeError,
        "static_argnums=(1,)",
    ),
    "linearize f": (lambda: mw.linearize(None, {"w": _X}), TypeError, "f"),
    "linearize params": (lambda: mw.linearize(_PAIR, {"n": jnp.arange(3)}), TypeError, "params"),
    "linearize new_params": (
        lambda: mw.linearize(lambda p, x: p["w"] * x, {"w": _X})({"v": _X}, 1.0),
        ValueError,
        "new_params",
    ),
    "accumulate_grad microbatches": (
        lambda: mw.accumulate_grad(lambda p, b: jnp.sum(p * b), 1.0, _X, microbatches=3),
        ValueError,
        "microbatches",
    ),
    "kernel_regression ridge": (
        lambda: mw.ntk.kernel_regression(
            mw.ntk.kernels.serial(mw.ntk.kernels.Dense()), _X, jnp.ones(4), _X, ridge=-1.0
        ),
        ValueError,
        "ridge",
    ),
    "predict t": (
        lambda: mw.ntk.predict(
            mw.ntk.kernels.serial(mw.ntk.kernels.Dense()), _X, jnp.ones(4), _X, ridge=1e-3, t=-1.0
        ),
        ValueError,
        "t must",
    ),
    "predict get": (
        lambda: mw.ntk.predict(
            mw.ntk.kernels.serial(mw.ntk.kernels.Dense()),
            _X,
            jnp.ones(4),
            _X,
            ridge=1e-3,
            get="both",
        ),
        ValueError,
        "get",
    ),
    "taylor_expand degree": (
        lambda: mw.taylor_expand(lambda p, x: p["w"] * x, {"w": _X}, -1),
        ValueError,
        "degree",
    ),
    "kernels AvgPool strides": (
        lambda: mw.ntk.kernels.AvgPool((2, 2), strides=(2,)),
        ValueError,
        "strides",
    ),
    "linear_cross_entropy labels float": (
        lambda: mw.linear_cross_entropy(_X, _X.T, jnp.zeros(4)),
        TypeError,
        "labels",
    ),
    "linear_cross_entropy labels out of range": (
        lambda: mw.linear_cross_entropy(_X, _X.T, jnp.array([0, 1, 2, 4])),
        ValueError,
        "labels must be in [0, 4)",
    ),
    "linear_cross_entropy labels shape": (
        lambda: mw.linear_cross_entropy(_X, _X.T, jnp.zeros(3, int)),
        ValueError,
        "labels must have shape",
    ),
    "linear_cross_entropy w shape": (
        lambda: mw.linear_cross_entropy(_X, jnp.ones((3, 4)), jnp.zeros(4, int)),
        ValueError,
        "x's last dim",
    ),
    "linear_cross_entropy reduction": (
        lambda: mw.linear_cross_entropy(_X, _X.T, jnp.zeros(4, int), reduction="avg"),
        ValueError,
        "reduction",
    ),
    "memory_report fn": (lambda: mw.memory_report(3, _X), TypeError, "fn"),
    "fit budget": (lambda: mw.fit(jnp.sum, budget="lots"), ValueError, "budget"),
    # Options that reached Python's own comparisons ("'<' not supported", "unhashable").
    "scan unroll string": (
        lambda: mw.scan(lambda c, x: (c, None), 1.0, None, 3, unroll="2"),
        TypeError,
        "unroll must be a bool or an int >= 0",
    ),
    "scan reverse list": (
        lambda: mw.scan(lambda c, x: (c, None), 1.0, None, 3, reverse=[True]),
        TypeError,
        "reverse must be True or False",
    ),
    "pairwise reduce array": (
        lambda: mw.pairwise_reduce(_PAIR, _X, _X, reduce=np.array([1, 2])),
        ValueError,
        "reduce must be one of",
    ),
    "pairwise axis array": (
        lambda: mw.pairwise_reduce(_PAIR, _X, _X, axis=np.array([0, 1])),
        ValueError,
        "axis must be 1",
    ),
    "pairwise weights dict": (
        lambda: mw.pairwise_reduce(_PAIR, _X, _X, weights={"w": 1.0}),
        TypeError,
        "weights must be one array",
    ),
    "pairwise weights ragged list": (
        lambda: mw.pairwise_reduce(_PAIR, _X, _X, weights=[[1.0], [2.0, 3.0], [4.0], [5.0]]),
        TypeError,
        "weights must be one array",
    ),
    "ot init string": (
        lambda: mw.ot.sinkhorn(_X, _X, init="warm"),
        TypeError,
        "init must be None or a pair (f, g)",
    ),
    "ot init one potential": (
        lambda: mw.ot.sinkhorn(_X, _X, init=(jnp.zeros(4),)),
        TypeError,
        "init must be None or a pair (f, g)",
    ),
    "ot init string potential": (
        lambda: mw.ot.sinkhorn(_X, _X, init=(jnp.zeros(4), "zeros")),
        TypeError,
        "init's g must be an array",
    ),
}


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_input_names_the_argument(name):
    call, error, words = BAD_INPUTS[name]
    with pytest.raises(error) as info:
        call()
    assert words in str(info.value), str(info.value)
    assert "jax._src" not in str(info.value)


def _q_of_12():
    return jnp.ones((2, 12, 4))


def _no_kernel(x1, x2=None, *args, **kwargs):
    return None


# Every public count argument is checked by one helper (memwise._arguments.positive_int
# and non_negative_int) in one wording: (call with the count, its name, the least count).
COUNT_ARGUMENTS = {
    "accumulate_grad microbatches": (
        lambda v: mw.accumulate_grad(_PAIR, _X, _X, microbatches=v),
        "microbatches",
        1,
    ),
    "attention stripes": (
        lambda v: mw.attention(_q_of_12(), _q_of_12(), _q_of_12(), stripes=v),
        "stripes",
        1,
    ),
    "stripe stripes": (lambda v: mw.stripe(_q_of_12(), v), "stripe: stripes", 1),
    "scan checkpoints": (
        lambda v: mw.scan(lambda c, x: (c, None), 1.0, None, 3, checkpoints=v),
        "checkpoints",
        1,
    ),
    "scan nested checkpoints": (
        lambda v: mw.scan(lambda c, x: (c, None), 1.0, None, 3, schedule="nested", checkpoints=v),
        "checkpoints",
        1,
    ),
    "scan length": (lambda v: mw.scan(lambda c, x: (c, None), 1.0, None, v), "length", 0),
    "while_loop max_steps": (
        lambda v: mw.while_loop(lambda c: c < 3.0, lambda c: c + 1.0, 0.0, max_steps=v),
        "max_steps",
        1,
    ),
    "chunked_map chunk_size": (
        lambda v: mw.chunked_map(jnp.sin, _X, chunk_size=v),
        "chunk_size",
        1,
    ),
    "sinkhorn max_iterations": (
        lambda v: mw.ot.sinkhorn(_X, _X, max_iterations=v),
        "max_iterations",
        1,
    ),
    "sinkhorn_divergence min_iterations": (
        lambda v: mw.ot.sinkhorn_divergence(_X, _X, min_iterations=v),
        "min_iterations",
        0,
    ),
    "taylor_expand degree": (
        lambda v: mw.taylor_expand(lambda p, x: p["w"] * x, {"w": _X}, v),
        "degree",
        0,
    ),
    "nt.batch batch_size": (lambda v: nt.batch(_no_kernel, batch_size=v), "batch_size", 0),
    "nt.monte_carlo_kernel_fn n_samples": (
        lambda v: nt.monte_carlo_kernel_fn(None, _no_kernel, None, v),
        "n_samples",
        1,
    ),
    "nt.stax.Dense out_dim": (lambda v: nt.stax.Dense(v), "stax.Dense out_dim", 1),
}


@pytest.mark.parametrize("name", sorted(COUNT_ARGUMENTS))
def test_count_arguments_share_one_check(name):
    call, argument, least = COUNT_ARGUMENTS[name]
    wording = f"{argument} must be " + ("a positive int" if least == 1 else "an int >= 0")
    for value, error in ((least - 1, ValueError), (2.5, TypeError), (True, TypeError)):
        with pytest.raises(error) as info:
            call(value)
        assert str(info.value).startswith(wording), str(info.value)
        assert f"got {value!r}" in str(info.value), str(info.value)
