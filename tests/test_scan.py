"""memwise.scan / memwise.while_loop against jax.lax, plus memory, counts and errors."""

from __future__ import annotations

import equinox as eqx
import hypothesis
import hypothesis.strategies as st
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import memwise as mw
from memwise import knobs, schedule
from memwise.measure import compiled_memory

H = 4


def make_body(w):
    def body(carry, x):
        h, k = carry
        h = jnp.tanh(w @ h + x["a"] * (x["i"] % 3))
        return (h, k + 1), {"y": jnp.sum(h**2), "k": k}

    return body


def make_inputs(n, seed=0):
    key1, key2, key3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    w = 0.6 * jax.random.normal(key1, (H, H))
    xa = jax.random.normal(key2, (n, H))
    h0 = jax.random.normal(key3, (H,))
    return w, xa, h0


def loss_with(scan_fn, n, reverse=False, **kwargs):
    def loss(w, xa, h0):
        xs = {"a": xa, "i": jnp.arange(n)}
        (h, k), ys = scan_fn(make_body(w), (h0, jnp.int32(0)), xs, reverse=reverse, **kwargs)
        return jnp.sum(h**2) + jnp.sum(jnp.sin(ys["y"])) + k + jnp.sum(ys["k"])

    return loss


def assert_tree_close(a, b, rtol=1e-5, atol=1e-6):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


CASES = [
    ("binomial", None, False),
    ("binomial", 1, True),
    ("binomial", 3, False),
    ("binomial", "all", True),
    ("nested", None, False),
    ("nested", None, True),
    ("per_step", None, True),
    ("none", None, False),
]


@pytest.mark.parametrize("schedule_name, checkpoints, reverse", CASES)
def test_values_and_gradients_match_lax_scan(schedule_name, checkpoints, reverse):
    n = 23
    args = make_inputs(n)
    ref = loss_with(lax.scan, n, reverse)
    ours = loss_with(mw.scan, n, reverse, checkpoints=checkpoints, schedule=schedule_name)
    np.testing.assert_allclose(jax.jit(ours)(*args), ref(*args), rtol=1e-6)
    assert_tree_close(
        jax.jit(jax.grad(ours, argnums=(0, 1, 2)))(*args),
        jax.grad(ref, argnums=(0, 1, 2))(*args),
    )


@pytest.mark.slow
@hypothesis.settings(max_examples=8, deadline=None)
@hypothesis.given(
    n=st.integers(1, 40),
    checkpoints=st.integers(1, 12),
    reverse=st.booleans(),
    dtype=st.sampled_from(["float32", "float64"]),
)
def test_gradients_random_lengths(n, checkpoints, reverse, dtype):
    with jax.enable_x64(dtype == "float64"):
        w, xa, h0 = (a.astype(dtype) for a in make_inputs(n, seed=n))
        ref = loss_with(lax.scan, n, reverse)
        ours = loss_with(mw.scan, n, reverse, checkpoints=checkpoints)
        tol = 1e-5 if dtype == "float32" else 1e-12
        assert_tree_close(
            jax.grad(ours, argnums=(0, 1, 2))(w, xa, h0),
            jax.grad(ref, argnums=(0, 1, 2))(w, xa, h0),
            rtol=tol,
            atol=tol,
        )


def test_xs_none_with_length_and_y_none():
    w, _, h0 = make_inputs(1)

    def loss(fn, w, **kw):
        h, ys = fn(lambda h, _: (jnp.tanh(w @ h), None), h0, None, length=17, **kw)
        assert ys is None
        return jnp.sum(h)

    assert_tree_close(
        jax.grad(lambda w: loss(mw.scan, w, checkpoints=2))(w),
        jax.grad(lambda w: loss(lax.scan, w))(w),
    )
    assert_tree_close(
        jax.grad(lambda w: loss(mw.scan, w, schedule="nested"))(w),
        jax.grad(lambda w: loss(lax.scan, w))(w),
    )


def test_weak_typed_init_takes_body_dtype():
    carry, _ = mw.scan(lambda c, x: (c + x, None), 0.0, jnp.ones(5, jnp.float32))
    assert carry.dtype == jnp.float32 and float(carry) == 5.0


def counted_loss(n, **kwargs):
    calls = []

    def loss(w, xa, h0):
        def body(h, x):
            jax.debug.callback(lambda h: calls.append(1), h)
            return jnp.tanh(w @ h + x), None

        h, _ = mw.scan(body, h0, xa, **kwargs)
        return jnp.sum(h)

    return loss, calls


@pytest.mark.parametrize("n, checkpoints", [(50, 1), (100, 4), (257, 7)])
def test_body_evaluations_equal_schedule_optimum(n, checkpoints):
    loss, calls = counted_loss(n, checkpoints=checkpoints)
    jax.block_until_ready(jax.jit(jax.grad(loss))(*make_inputs(n)))
    assert len(calls) == schedule.evaluations(n, checkpoints)


def test_nested_evaluations_match_plan():
    n = 101
    loss, calls = counted_loss(n, schedule="nested")
    jax.block_until_ready(jax.jit(jax.grad(loss))(*make_inputs(n)))
    assert len(calls) == schedule.nested(n, 2).evaluations == 2 * n


def test_gradient_memory_does_not_grow_with_length():
    hidden = 64

    def loss_fn(n, **kwargs):
        def loss(w, xs):
            h, _ = mw.scan(lambda h, x: (jnp.tanh(w @ h + x), None), jnp.ones(hidden), xs,
                           **kwargs)
            return jnp.sum(h)

        return loss, (jnp.eye(hidden), jnp.ones((n, hidden)))

    temps = {}
    for n in (500, 2000):
        loss, args = loss_fn(n, checkpoints=8)
        temps[n] = compiled_memory(loss, *args, grad=True).temp_bytes
    carry_bytes = hidden * 4
    assert temps[2000] <= temps[500] + 4 * carry_bytes
    loss, args = loss_fn(2000, schedule="per_step")
    per_step = compiled_memory(loss, *args, grad=True).temp_bytes
    assert per_step >= 2000 * carry_bytes  # one carry per step
    assert temps[2000] < per_step / 20
    # the buffer of 8 carries is the part that scales with checkpoints
    loss, args = loss_fn(2000, checkpoints=64)
    more = compiled_memory(loss, *args, grad=True).temp_bytes
    assert more - temps[2000] >= 50 * carry_bytes


def test_program_size_independent_of_length():
    def eqn_count(n):
        loss = loss_with(mw.scan, n, checkpoints=5)
        jaxpr = jax.make_jaxpr(jax.grad(loss))(*make_inputs(n))

        def count(j):
            total = 0
            for eqn in j.eqns:
                total += 1
                for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                    total += count(sub)
            return total

        return count(jaxpr.jaxpr)

    assert eqn_count(100) == eqn_count(5000)


@pytest.mark.parametrize("argnums", [(0,), (1,), (2,), (1, 2)])
def test_gradient_with_respect_to_some_inputs_only(argnums):
    # The inputs nobody differentiates reach the backward pass as symbolic zeros and get
    # no cotangent; the ones asked for must still be exact.
    n = 17
    args = make_inputs(n)
    ref = loss_with(lax.scan, n, reverse=True)
    ours = loss_with(mw.scan, n, reverse=True, checkpoints=3)
    assert_tree_close(
        jax.jit(jax.grad(ours, argnums=argnums))(*args),
        jax.grad(ref, argnums=argnums)(*args),
    )


@pytest.mark.parametrize("used", ["final carry", "ys"])
def test_gradient_when_only_the_final_carry_or_only_ys_is_used(used):
    n = 21
    w, xa, h0 = make_inputs(n)

    def loss(scan_fn, **kwargs):
        def f(w, xa, h0):
            h, ys = scan_fn(lambda h, x: (jnp.tanh(w @ h + x), jnp.sum(h * x)), h0, xa,
                            **kwargs)
            return jnp.sum(h**2) if used == "final carry" else jnp.sum(jnp.cos(ys))

        return f

    assert_tree_close(
        jax.jit(jax.grad(loss(mw.scan, checkpoints=4), argnums=(0, 1, 2)))(w, xa, h0),
        jax.grad(loss(lax.scan), argnums=(0, 1, 2))(w, xa, h0),
    )


def test_vmap_of_grad_and_grad_of_vmap():
    n = 19
    w, xa, h0 = make_inputs(n)
    xab = jnp.stack([xa, 2 * xa, -xa])
    ref = loss_with(lax.scan, n)
    ours = loss_with(mw.scan, n, checkpoints=3)
    batched = jax.vmap(jax.grad(ours, argnums=(0, 1)), in_axes=(None, 0, None))
    expected = jax.vmap(jax.grad(ref, argnums=(0, 1)), in_axes=(None, 0, None))
    assert_tree_close(jax.jit(batched)(w, xab, h0), expected(w, xab, h0))

    def summed(fn):
        return lambda w: jnp.sum(jax.vmap(fn, in_axes=(None, 0, None))(w, xab, h0))

    assert_tree_close(jax.grad(summed(ours))(w), jax.grad(summed(ref))(w))


def test_forward_mode_binomial_raises_naming_nested():
    n = 9
    w, xa, h0 = make_inputs(n)
    ours = loss_with(mw.scan, n, checkpoints=3)
    with pytest.raises(TypeError, match="schedule='nested'"):
        jax.jvp(lambda w: ours(w, xa, h0), (w,), (jnp.ones_like(w),))
    with pytest.raises(TypeError, match="schedule='nested'"):
        jax.jacfwd(lambda w: ours(w, xa, h0))(w)


def test_nested_under_jvp_and_grad_of_grad():
    n = 30
    w, xa, h0 = make_inputs(n)
    ref = loss_with(lax.scan, n)
    ours = loss_with(mw.scan, n, schedule="nested", checkpoints=12)
    tangent = jnp.ones_like(w)
    assert_tree_close(
        jax.jvp(lambda w: ours(w, xa, h0), (w,), (tangent,)),
        jax.jvp(lambda w: ref(w, xa, h0), (w,), (tangent,)),
    )

    def hvp(fn):
        return jax.grad(lambda w: jnp.vdot(jax.grad(fn)(w, xa, h0), tangent))(w)

    assert_tree_close(hvp(ours), hvp(ref), rtol=1e-4, atol=1e-5)


def test_equinox_module_params_get_gradients():
    cell = eqx.nn.GRUCell(3, 5, key=jax.random.PRNGKey(0))
    xs = jax.random.normal(jax.random.PRNGKey(1), (40, 3))

    def loss(cell, fn, **kw):
        h, _ = fn(lambda h, x: (cell(x, h), None), jnp.zeros(5), xs, **kw)
        return jnp.sum(h**2)

    ours = eqx.filter_grad(lambda c: loss(c, mw.scan, checkpoints=4))(cell)
    ref = eqx.filter_grad(lambda c: loss(c, lax.scan))(cell)
    leaves = jax.tree_util.tree_leaves(eqx.filter(ours, eqx.is_array))
    assert leaves and all(float(jnp.abs(a).max()) > 0 for a in leaves)
    assert_tree_close(eqx.filter(ours, eqx.is_array), eqx.filter(ref, eqx.is_array))


def test_checkpoints_resolution_and_auto_knob():
    assert mw.scan.__module__ == "memwise.scan"
    from memwise.scan import resolve_checkpoints

    assert resolve_checkpoints(None, 10_000) == schedule.min_checkpoints(10_000, 30_000)
    assert resolve_checkpoints("all", 50) == 50
    assert resolve_checkpoints(500, 50) == 50
    assert resolve_checkpoints("auto", 1000) == resolve_checkpoints(None, 1000)

    def planned():  # one call site, so both recordings see the same knob
        return resolve_checkpoints("auto", 1000)

    with knobs.recording() as recorded:
        planned()
    (knob,) = recorded
    assert knob.kind == "checkpoints"
    assert knob.default == resolve_checkpoints(None, 1000)
    assert list(knob.candidates) == sorted(knob.candidates, reverse=True)
    assert knob.cost[0] == 1.0 and list(knob.cost) == sorted(knob.cost)
    with knobs.recording(plan=[len(knob.candidates) - 1], layout=recorded):
        assert planned() == knob.candidates[-1]


def test_bad_inputs():
    xs = jnp.ones((5, 2))
    body = lambda c, x: (c + x, None)  # noqa: E731
    init = jnp.zeros(2)
    with pytest.raises(ValueError, match="checkpoints"):
        mw.scan(body, init, xs, checkpoints=0)
    with pytest.raises(TypeError, match="checkpoints"):
        mw.scan(body, init, xs, checkpoints=2.5)
    with pytest.raises(ValueError, match="checkpoints"):
        mw.scan(body, init, xs, checkpoints="many")
    with pytest.raises(ValueError, match="same number of steps"):
        mw.scan(lambda c, x: (c, None), init, (xs, jnp.ones((4, 2))))
    with pytest.raises(ValueError, match="length"):
        mw.scan(body, init, xs, length=4)
    with pytest.raises(ValueError, match="at least one step"):
        mw.scan(body, init, jnp.ones((0, 2)))
    with pytest.raises(ValueError, match="length"):
        mw.scan(body, init, None)
    with pytest.raises(TypeError, match="f must be callable"):
        mw.scan(None, init, xs)
    with pytest.raises(TypeError, match="structure"):
        mw.scan(lambda c, x: ((c, c), None), init, xs)
    with pytest.raises(TypeError, match="shapes/dtypes"):
        mw.scan(lambda c, x: (c.astype(jnp.int32), None), init, xs)
    with pytest.raises(TypeError, match="shapes/dtypes"):
        mw.scan(lambda c, x: (c[:1], None), init, xs)
    with pytest.raises(ValueError, match="schedule"):
        mw.scan(body, init, xs, schedule="treeverse")
    with pytest.raises(ValueError, match="no effect"):
        mw.scan(body, init, xs, schedule="per_step", checkpoints=3)


# --------------------------------------------------------------------------------------
# while_loop


def newton(a, loop, steps=20):
    def body(state):
        x, i = state
        return 0.5 * (x + a / x), i + 1

    return loop(lambda s: s[1] < steps, body, (a, jnp.int32(0)))


def reference_newton(a, steps):
    return lax.fori_loop(0, steps, lambda i, x: 0.5 * (x + a / x), a)


@pytest.mark.parametrize("max_steps, checkpoints, steps", [(100, 4, 20), (30, 2, 30), (64, None, 7)])
def test_while_loop_matches_lax(max_steps, checkpoints, steps):
    ours = lambda a: newton(a, lambda c, b, i: mw.while_loop(  # noqa: E731
        c, b, i, max_steps=max_steps, checkpoints=checkpoints), steps)[0]
    lax_value = newton(3.0, lax.while_loop, steps)[0]
    np.testing.assert_allclose(jax.jit(ours)(3.0), lax_value, rtol=1e-6)
    np.testing.assert_allclose(
        jax.jit(jax.grad(ours))(3.0), jax.grad(lambda a: reference_newton(a, steps))(3.0),
        rtol=1e-5,
    )


def test_while_loop_closure_gradients_and_zero_trips():
    w, _, h0 = make_inputs(1)

    def run(w, h0, limit):
        def body(s):
            h, i = s
            return jnp.tanh(w @ h), i + 1

        h, _ = mw.while_loop(lambda s: s[1] < limit, body, (h0, 0), max_steps=50, checkpoints=3)
        return jnp.sum(h**2)

    def ref(w, h0, limit):
        h = lax.fori_loop(0, limit, lambda i, h: jnp.tanh(w @ h), h0)
        return jnp.sum(h**2)

    for limit in (0, 1, 13, 50):
        assert_tree_close(
            jax.grad(run, argnums=(0, 1))(w, h0, limit),
            jax.grad(ref, argnums=(0, 1))(w, h0, limit),
        )
    # trip count beyond max_steps stops at max_steps
    np.testing.assert_allclose(run(w, h0, 80), ref(w, h0, 50), rtol=1e-6)


@pytest.mark.parametrize("argnums", [(0,), (1,)])
def test_while_loop_gradient_with_respect_to_one_input(argnums):
    w, _, h0 = make_inputs(1)

    def run(w, h0):
        h, _ = mw.while_loop(lambda s: s[1] < 11, lambda s: (jnp.tanh(w @ s[0]), s[1] + 1),
                             (h0, 0), max_steps=40, checkpoints=3)
        return jnp.sum(h**2)

    def ref(w, h0):
        return jnp.sum(lax.fori_loop(0, 11, lambda i, h: jnp.tanh(w @ h), h0) ** 2)

    assert_tree_close(
        jax.jit(jax.grad(run, argnums=argnums))(w, h0), jax.grad(ref, argnums=argnums)(w, h0)
    )


def test_while_loop_predicate_closure_is_not_differentiated():
    # cond_fun closes over a differentiated array: the trip count depends on it only
    # through a comparison, so its gradient is zero, and the body's gradients are exact.
    w, _, h0 = make_inputs(1)

    def run(w, h0, threshold):
        h, _ = mw.while_loop(lambda s: s[1] < threshold,
                             lambda s: (jnp.tanh(w @ s[0]), s[1] + 1),
                             (h0, 0), max_steps=30, checkpoints=2)
        return jnp.sum(h**2)

    def ref(w, h0):
        return jnp.sum(lax.fori_loop(0, 9, lambda i, h: jnp.tanh(w @ h), h0) ** 2)

    g_w, g_h0, g_threshold = jax.grad(run, argnums=(0, 1, 2))(w, h0, 8.5)
    assert_tree_close((g_w, g_h0), jax.grad(ref, argnums=(0, 1))(w, h0))
    assert float(g_threshold) == 0.0


def test_while_loop_forward_mode_raises_naming_nested():
    def f(a):
        return mw.while_loop(lambda s: s[1] < 5, lambda s: (s[0] * a, s[1] + 1),
                             (a, 0), max_steps=10)[0]

    with pytest.raises(TypeError, match="memwise.while_loop.*schedule='nested'"):
        jax.jvp(f, (2.0,), (1.0,))


def test_while_loop_vmap_different_trip_counts():
    a = jnp.array([2.0, 3.0, 5.0])
    limits = jnp.array([3, 9, 17])

    def ours(a, limit):
        x, _ = mw.while_loop(lambda s: s[1] < limit,
                             lambda s: (0.5 * (s[0] + a / s[0]), s[1] + 1),
                             (a, 0), max_steps=20, checkpoints=3)
        return x

    grads = jax.vmap(jax.grad(ours))(a, limits)
    expected = [jax.grad(lambda a: reference_newton(a, int(k)))(float(v))
                for v, k in zip(a, limits)]
    np.testing.assert_allclose(grads, expected, rtol=1e-5)


def test_while_loop_memory_is_checkpoints_not_max_steps():
    hidden = 64

    def loss_fn(max_steps):
        def loss(w):
            h, _ = mw.while_loop(lambda s: s[1] < 300,
                                 lambda s: (jnp.tanh(w @ s[0]), s[1] + 1),
                                 (jnp.ones(hidden), 0), max_steps=max_steps, checkpoints=6)
            return jnp.sum(h)

        return loss

    small = compiled_memory(loss_fn(500), jnp.eye(hidden), grad=True).temp_bytes
    large = compiled_memory(loss_fn(5000), jnp.eye(hidden), grad=True).temp_bytes
    assert large <= small + 4 * hidden * 4
    assert large < 100 * hidden * 4


def test_while_loop_bad_inputs():
    body = lambda s: s + 1.0  # noqa: E731
    with pytest.raises(ValueError, match="max_steps"):
        mw.while_loop(lambda s: s < 3, body, 0.0, max_steps=0)
    with pytest.raises(TypeError, match="max_steps"):
        mw.while_loop(lambda s: s < 3, body, 0.0, max_steps=None)
    with pytest.raises(TypeError, match="cond_fun"):
        mw.while_loop(None, body, 0.0, max_steps=3)
    with pytest.raises(TypeError, match="boolean scalar"):
        mw.while_loop(lambda s: s, body, 0.0, max_steps=3)
    with pytest.raises(TypeError, match="body_fun"):
        mw.while_loop(lambda s: s < 3, lambda s: (s, s), 0.0, max_steps=3)
    with pytest.raises(ValueError, match="checkpoints"):
        mw.while_loop(lambda s: s < 3, body, 0.0, max_steps=3, checkpoints=0)
