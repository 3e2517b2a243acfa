"""memwise.scan(..., inverse=): reversible steps against jax.lax.scan, memory, drift, errors.

Two reversible steps: a reversible residual network (RevNet additive coupling, Gomez et
al. 2017: y1 = x1 + F(x2), y2 = x2 + G(y1)) and the reversible Heun method for an SDE
(Kidger et al. 2021). The reference is ``jax.lax.scan`` of the same step, which keeps
every carry; values and gradients must agree to 1e-5 in float32 and 1e-10 in float64.
"""

from __future__ import annotations

import _draw
import jax
import jax.numpy as jnp
import pytest

import memwise as mw
from memwise.measure import compiled_memory

WIDTH = 6


pytestmark = pytest.mark.usefixtures("float64_module")


def revnet(params):
    """A RevNet block sequence with shared weights: ``(step, inverse)`` on ``(x1, x2)``.

    xs are per-step inputs added inside F; ys is a per-step readout of y1.
    """
    w_f, w_g, scale = params

    def residual_f(x2, x):
        return scale * jnp.tanh(x2 @ w_f + x)

    def residual_g(y1):
        return scale * jnp.tanh(y1 @ w_g)

    def step(carry, x):
        x1, x2 = carry
        y1 = x1 + residual_f(x2, x)
        y2 = x2 + residual_g(y1)
        return (y1, y2), jnp.sum(y1**2)

    def inverse(carry, x):
        y1, y2 = carry
        x2 = y2 - residual_g(y1)
        return (y1 - residual_f(x2, x), x2)

    return step, inverse


def revnet_inputs(n, dtype, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    w_f = (_draw.normal(keys[0], (WIDTH, WIDTH)) / WIDTH).astype(dtype)
    w_g = (_draw.normal(keys[1], (WIDTH, WIDTH)) / WIDTH).astype(dtype)
    xs = (0.3 * _draw.normal(keys[2], (n, WIDTH))).astype(dtype)
    x1 = _draw.normal(keys[3], (WIDTH,)).astype(dtype)
    x2 = _draw.normal(keys[4], (WIDTH,)).astype(dtype)
    return (w_f, w_g, jnp.asarray(0.5, dtype)), (x1, x2), xs


def revnet_loss(scan, readout=True, **options):
    def loss(params, init, xs):
        step, inverse = revnet(params)
        if scan is mw.scan:
            options["inverse"] = inverse
        (y1, y2), ys = scan(step, init, xs, **options)
        return jnp.sum(y1 * y2) + (jnp.sum(jnp.sin(ys)) if readout else 0.0)

    return loss


def relative_error(actual, expected):
    worst = 0.0
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        assert a.shape == e.shape and a.dtype == e.dtype, (a, e)
        if e.size == 0:
            continue
        scale = max(float(jnp.max(jnp.abs(e))), 1e-30)
        worst = max(worst, float(jnp.max(jnp.abs(a - e))) / scale)
    return worst


TOLERANCE = {"float32": 1e-5, "float64": 1e-10}


@pytest.mark.slow
@pytest.mark.parametrize(
    "dtype, checkpoints, reverse",
    [
        ("float32", None, False),
        ("float32", 4, True),
        ("float64", None, True),
        ("float64", 5, False),
        ("float64", "all", False),
    ],
)
def test_revnet_values_and_gradients_match_lax_scan(dtype, checkpoints, reverse):
    params, init, xs = revnet_inputs(60, jnp.dtype(dtype))
    ours = revnet_loss(mw.scan, checkpoints=checkpoints, reverse=reverse)
    reference = revnet_loss(jax.lax.scan, reverse=reverse)
    value, grads = jax.jit(jax.value_and_grad(ours, argnums=(0, 1, 2)))(params, init, xs)
    expected, expected_grads = jax.jit(jax.value_and_grad(reference, argnums=(0, 1, 2)))(
        params, init, xs
    )
    assert relative_error(value, expected) < TOLERANCE[dtype]
    assert relative_error(grads, expected_grads) < TOLERANCE[dtype]
    assert all(g.dtype == jnp.dtype(dtype) for g in jax.tree.leaves(grads))


def heun(vector_field, noise):
    """The reversible Heun method for dy = f(t, y) dt + g(t, y) dW (Kidger et al. 2021).

    The carry is ``(y, z, f(t, z), g(t, z))``; xs are ``(t, dt, dW)`` per step. Step:
    ``z' = 2y - z + f dt + g dW``, ``y' = y + (f + f') dt / 2 + (g + g') dW / 2`` with
    ``f' = f(t + dt, z')``; its algebraic inverse recovers ``z`` from ``(y', z', f', g')``.
    """

    def step(carry, x):
        y, z, f, g = carry
        t, dt, dw = x
        z_next = 2 * y - z + f * dt + g * dw
        f_next, g_next = vector_field(t + dt, z_next), noise(t + dt, z_next)
        y_next = y + 0.5 * (f + f_next) * dt + 0.5 * (g + g_next) * dw
        return (y_next, z_next, f_next, g_next), y_next

    def inverse(carry, x):
        y_next, z_next, f_next, g_next = carry
        t, dt, dw = x
        z = 2 * y_next - z_next - f_next * dt - g_next * dw
        f, g = vector_field(t, z), noise(t, z)
        y = y_next - 0.5 * (f + f_next) * dt - 0.5 * (g + g_next) * dw
        return (y, z, f, g)

    return step, inverse


def heun_loss(scan, n, **options):
    def loss(theta, y0, key):
        def vector_field(t, y):
            return jnp.tanh(theta[0] * y + theta[1] * jnp.sin(t)) - theta[2] * y

        def noise(t, y):
            return theta[3] * jnp.cos(y)

        step, inverse = heun(vector_field, noise)
        dt = jnp.full((n,), 1.0 / n, y0.dtype)
        t = jnp.cumsum(dt) - dt
        dw = jnp.sqrt(dt)[:, None] * _draw.normal(key, (n,) + y0.shape, y0.dtype)
        init = (y0, y0, vector_field(0.0, y0), noise(0.0, y0))
        if scan is mw.scan:
            options["inverse"] = inverse
        (y, *_), ys = scan(step, init, (t, dt[:, None], dw), **options)
        return jnp.sum(y**2) + jnp.mean(ys)

    return loss


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_reversible_heun_sde_matches_lax_scan(dtype):
    theta = jnp.asarray([1.3, 0.5, 0.2, 0.3], dtype)
    y0 = jnp.linspace(-1.0, 1.0, 4, dtype=dtype)
    key = jax.random.PRNGKey(7)
    log = mw.DriftLog()
    ours = jax.jit(jax.value_and_grad(heun_loss(mw.scan, 200, drift=log), argnums=(0, 1)))
    value, grads = ours(theta, y0, key)
    expected, expected_grads = jax.jit(
        jax.value_and_grad(heun_loss(jax.lax.scan, 200), argnums=(0, 1))
    )(theta, y0, key)
    assert relative_error(value, expected) < TOLERANCE[dtype]
    assert relative_error(grads, expected_grads) < TOLERANCE[dtype]
    # The reversible Heun method is algebraically reversible: the 200 rebuilt steps end
    # on y0 up to rounding.
    (record,) = log.records
    assert (record.step, record.steps_rebuilt) == (0, 200)
    assert record.relative < (1e-5 if dtype == "float32" else 1e-12)


@pytest.mark.slow
def test_drift_log_measures_each_kept_carry_and_check_raises_above_tolerance():
    params, init, xs = revnet_inputs(40, jnp.float32)
    log = mw.DriftLog()
    # (each gradient compiled: eager, each operation of the loops was compiled alone)
    jax.jit(jax.grad(revnet_loss(mw.scan, checkpoints=4, drift=log)))(params, init, xs)
    records = log.records
    assert [(d.step, d.steps_rebuilt) for d in records] == [(0, 10), (10, 10), (20, 10), (30, 10)]
    # float32 rounding: a drift that is measurable, and small
    assert 0.0 < log.max_relative < 1e-5
    assert log.max_absolute == max(d.absolute for d in records)
    log.check(1e-5)
    with pytest.raises(ValueError, match="checkpoints="):
        log.check(1e-12)

    # An inverse that is off by a little: the log shows it at every kept carry.
    step, inverse = revnet(params)
    sloppy = lambda c, x: jax.tree.map(lambda a: a * (1 + 1e-3), inverse(c, x))  # noqa: E731
    bad = mw.DriftLog()
    jax.jit(
        jax.grad(
            lambda i: mw.scan(step, i, xs, inverse=sloppy, checkpoints=2, drift=bad)[0][0].sum()
        )
    )(init)
    assert len(bad.records) == 2 and min(d.relative for d in bad.records) > 1e-3
    bad.clear()
    assert bad.records == [] and bad.max_relative == 0.0

    # In float64 the same loop drifts by rounding only.
    params, init, xs = revnet_inputs(40, jnp.float64)
    exact = mw.DriftLog()
    jax.jit(jax.grad(revnet_loss(mw.scan, checkpoints=4, drift=exact)))(params, init, xs)
    assert exact.max_relative < 1e-13


@pytest.mark.slow
def test_drift_log_under_vmap_records_each_batch_element():
    params, init, xs = revnet_inputs(12, jnp.float32)
    log = mw.DriftLog()
    loss = revnet_loss(mw.scan, checkpoints=3, drift=log)
    batch = jnp.stack([xs, 2 * xs])
    grads = jax.jit(jax.vmap(jax.grad(loss, argnums=2), in_axes=(None, None, 0)))(
        params, init, batch
    )
    expected = jax.jit(
        jax.vmap(jax.grad(revnet_loss(jax.lax.scan), argnums=2), in_axes=(None, None, 0))
    )(params, init, batch)
    assert relative_error(grads, expected) < 1e-5
    assert len(log.records) == 2 * 3


@pytest.mark.slow
def test_gradient_memory_is_constant_in_the_length():
    def temp(n, scan, **options):
        params, init, xs = revnet_inputs(n, jnp.float32)
        loss = revnet_loss(scan, readout=False, **options)
        return compiled_memory(jax.grad(loss), params, init, xs).temp_bytes

    reversible = {n: temp(n, mw.scan) for n in (200, 2000)}
    assert reversible[2000] == reversible[200]
    kept = {n: temp(n, mw.scan, checkpoints=8) for n in (200, 2000)}
    assert kept[2000] == kept[200] and kept[200] >= reversible[200] + 7 * 2 * WIDTH * 4
    # Per-step outputs are n long, and so is their cotangent: that part is the user's.
    params, init, xs = revnet_inputs(2000, jnp.float32)
    with_ys = compiled_memory(jax.grad(revnet_loss(mw.scan)), params, init, xs).temp_bytes
    assert with_ys <= reversible[2000] + 2 * 2000 * 4 + 1024
    # Per-step outputs are n long, and so is their cotangent: that part is the user's.
    params, init, xs = revnet_inputs(2000, jnp.float32)
    with_ys = compiled_memory(jax.grad(revnet_loss(mw.scan)), params, init, xs).temp_bytes
    assert with_ys <= reversible[2000] + 2 * 2000 * 4 + 1024
    # lax.scan keeps every step: ten times the steps, about ten times the memory
    assert temp(2000, jax.lax.scan) > 5 * temp(200, jax.lax.scan) > 20 * reversible[200]


@pytest.mark.slow
def test_read_only_and_integer_carry_leaves_and_xs_none():
    # a step counter (int) rebuilt by the inverse, a carried constant (read only), no xs
    def counted(w, scan, **options):
        def step(c, _):
            h, k, scale = c
            return (h + scale * w, k + 1, scale), k

        def inverse(c, _):
            h, k, scale = c
            return (h - scale * w, k - 1, scale)

        if scan is mw.scan:
            options["inverse"] = inverse
        (h, k, _), ks = scan(step, (jnp.ones(3), jnp.int32(0), 0.5), None, length=5, **options)
        return jnp.sum(h**2) * (k + ks.sum())

    g = jax.grad(counted)(0.3, mw.scan)
    assert abs(float(g) - float(jax.grad(counted)(0.3, jax.lax.scan))) < 1e-10


@pytest.mark.slow
def test_length_zero_and_one():
    params, init, xs = revnet_inputs(1, jnp.float64)
    step, inverse = revnet(params)
    for n in (0, 1):
        ours = mw.scan(step, init, xs[:n], inverse=inverse)
        expected = jax.lax.scan(step, init, xs[:n])
        assert relative_error(ours, expected) == 0.0
        grads = jax.grad(revnet_loss(mw.scan), argnums=(0, 1))(params, init, xs[:n])
        expected = jax.grad(revnet_loss(jax.lax.scan), argnums=(0, 1))(params, init, xs[:n])
        assert relative_error(grads, expected) < 1e-12


@pytest.mark.slow
def test_forward_mode_raises_and_forward_over_reverse_works():
    params, init, xs = revnet_inputs(6, jnp.float64)

    def loss(x1, scan):
        return revnet_loss(scan)(params, (x1, init[1]), xs)

    with pytest.raises(TypeError, match="inverse="):
        jax.jvp(lambda x1: loss(x1, mw.scan), (init[0],), (init[0],))
    with pytest.raises(TypeError, match="forward-over-reverse"):
        jax.grad(lambda x1: jax.grad(loss)(x1, mw.scan).sum())(init[0])
    hessian = jax.hessian(loss)(init[0], mw.scan)
    assert relative_error(hessian, jax.hessian(loss)(init[0], jax.lax.scan)) < 1e-10


@pytest.mark.parametrize(
    "options, error, words",
    [
        ({"inverse": 3}, TypeError, "inverse must be callable"),
        ({"inverse": lambda c, x: (c, None)}, TypeError, "inverse must return the carry"),
        ({"inverse": lambda c, x: c.astype(jnp.int32)}, TypeError, "inverse changed the type"),
        ({"inverse": lambda c, x: c[:1]}, TypeError, "inverse changed the type"),
        ({"drift": mw.DriftLog()}, ValueError, "pass inverse="),
        ({"inverse": lambda c, x: c - x, "drift": []}, TypeError, "drift must be"),
        ({"inverse": lambda c, x: c - x, "schedule": "nested"}, ValueError, "schedule="),
        ({"inverse": lambda c, x: c - x, "checkpoints": "auto"}, ValueError, "checkpoints="),
        ({"inverse": lambda c, x: c - x, "checkpoints": 0}, ValueError, "checkpoints="),
    ],
)
def test_bad_inverse_options_name_the_argument(options, error, words):
    with pytest.raises(error, match=words) as info:
        mw.scan(lambda c, x: (c + x, None), jnp.zeros(2), jnp.ones((3, 2)), **options)
    assert "jax._src" not in str(info.value)


@pytest.mark.slow
def test_gradient_evaluates_the_body_2n_times_and_the_inverse_n_times():
    calls = {"step": 0, "inverse": 0}

    def count(name):
        def bump(*_):
            calls[name] += 1

        return bump

    def loss(w, xs):
        def step(h, x):
            jax.debug.callback(count("step"))
            return h + jnp.sin(w * x), None

        def inverse(h, x):
            jax.debug.callback(count("inverse"))
            return h - jnp.sin(w * x)

        return mw.scan(step, jnp.zeros(3), xs, inverse=inverse, checkpoints=3)[0].sum()

    jax.block_until_ready(jax.jit(jax.grad(loss))(0.5, jnp.ones((10, 3))))
    jax.effects_barrier()
    assert calls == {"step": 20, "inverse": 10}
