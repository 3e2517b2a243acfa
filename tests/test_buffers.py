"""Write-only buffers of ``memwise.while_loop`` against Equinox's and plain JAX.

The dtype x transformation x edge rows (zero steps, an index written twice, a buffer
never written) are in test_matrix.py, the bad inputs in its bad-input table; here:
Equinox's checkpointed ``while_loop(..., buffers=)`` on the same loop, writes under a
predicate, a nested loop writing the enclosing loop's buffer, integer buffers, a
batched condition, and that a buffer is not checkpointed (compiled memory at two
checkpoint counts).
"""

from __future__ import annotations

import equinox.internal as eqxi
import jax
import jax.numpy as jnp
import pytest
from _close import assert_close
from jax import lax

import memwise as mw
from memwise.measure import compiled_memory

# each test compiles a few gradients: seconds apiece on the 2-core machine
pytestmark = pytest.mark.slow

_W = jnp.array([[0.6, -0.3, 0.1], [0.2, 0.5, -0.4], [-0.1, 0.3, 0.7]])


def _saving_loop(while_loop, steps, **options):
    """h <- tanh(W h + x_i), saving h every step and its norm on even steps."""

    def loss(w, h0, xs):
        def body(s):
            i, h, hs, norms = s
            h = jnp.tanh(w @ h + xs[i])
            return i + 1, h, hs.at[i].set(h), norms.at[i // 2].set(jnp.sum(h * h))

        init = (0, h0, jnp.zeros((steps + 2, 3)), jnp.full((steps // 2 + 2,), -1.0))
        _, h, hs, norms = while_loop(lambda s: s[0] < steps, body, init, **options)
        return jnp.sum(h) + jnp.sum(jnp.sin(hs)) + jnp.sum(norms * jnp.arange(norms.shape[0]))

    return loss


def _dense(steps):
    def loss(w, h0, xs):
        def step(carry, x):
            h = jnp.tanh(w @ carry + x)
            return h, h

        h, hs = lax.scan(step, h0, xs[:steps])
        hs_full = jnp.zeros((steps + 2, 3)).at[:steps].set(hs)
        norms = jnp.full((steps // 2 + 2,), -1.0)
        for i in range(steps):  # the later write at i // 2 wins
            norms = norms.at[i // 2].set(jnp.sum(hs[i] * hs[i]))
        return jnp.sum(h) + jnp.sum(jnp.sin(hs_full)) + jnp.sum(norms * jnp.arange(norms.shape[0]))

    return loss


@pytest.mark.parametrize("steps, checkpoints", [(1, 1), (9, 2), (30, 4)])
def test_equals_equinox_and_lax_scan(steps, checkpoints):
    args = (_W, jnp.array([0.3, -0.2, 0.5]), jnp.linspace(-1.0, 1.0, 3 * 32).reshape(32, 3))
    buffers = lambda s: (s[2], s[3])  # noqa: E731
    # each compiled once (eager, each operation of the loops was compiled alone)
    ours = jax.jit(
        jax.value_and_grad(
            _saving_loop(mw.while_loop, steps, checkpoints=checkpoints, buffers=buffers), (0, 1, 2)
        )
    )(*args)
    equinox = jax.jit(
        jax.value_and_grad(
            _saving_loop(
                eqxi.while_loop,
                steps,
                kind="checkpointed",
                max_steps=64,
                checkpoints=checkpoints,
                buffers=buffers,
            ),
            (0, 1, 2),
        )
    )(*args)
    dense = jax.jit(jax.value_and_grad(_dense(steps), (0, 1, 2)))(*args)
    assert_close(ours[0], dense[0], 1e-6, "value")
    for a, c in zip(ours[1], dense[1]):
        assert_close(a, c, 1e-5, "gradient against lax.scan")
    # Equinox assumes each index is written once (its documented, unchecked contract):
    # with the norms written twice at i // 2 (steps > 1) its gradient also credits the
    # overwritten write, so only the value and the one-step gradient are compared.
    assert_close(ours[0], equinox[0], 1e-6, "value against Equinox")
    if steps == 1:
        for a, b in zip(ours[1], equinox[1]):
            assert_close(a, b, 1e-5, "gradient against Equinox")


def test_write_once_gradients_equal_equinox():
    def loss(while_loop, **options):
        def f(w, h0):
            def body(s):
                i, h, hs = s
                h = jnp.tanh(w @ h)
                return i + 1, h, hs.at[i].set(h)

            _, _, hs = while_loop(
                lambda s: s[0] < 12,
                body,
                (0, h0, jnp.zeros((12, 3))),
                buffers=lambda s: s[2],
                **options,
            )
            return jnp.sum(hs**3)

        return jax.jit(jax.grad(f, (0, 1)))  # compiled: one program

    args = (_W, jnp.array([0.3, -0.2, 0.5]))
    ours = loss(mw.while_loop, checkpoints=3)(*args)
    equinox = loss(eqxi.while_loop, kind="checkpointed", max_steps=16, checkpoints=3)(*args)
    for a, b in zip(ours, equinox):
        assert_close(a, b, 1e-6, "gradient against Equinox")


def test_predicated_writes_and_the_initial_buffer():
    def f(w, b0):
        def body(s):
            i, h, out = s
            h = jnp.tanh(w * h + 0.3)
            return i + 1, h, out.at[i].set(h, pred=(i % 3) != 1)

        return mw.while_loop(
            lambda s: s[0] < 6, body, (0, 0.5, b0), checkpoints=2, buffers=lambda s: s[2]
        )[2]

    def dense(w, b0):
        h, out = 0.5, b0
        for i in range(6):
            h = jnp.tanh(w * h + 0.3)
            if i % 3 != 1:
                out = out.at[i].set(h)
        return out

    b0 = jnp.linspace(1.0, 2.0, 8)
    weights = jnp.arange(1.0, 9.0)

    def run(fn):  # value and gradients, one compiled program
        grad = jax.grad(lambda w, b: jnp.sum(fn(w, b) * weights), (0, 1))
        return jax.jit(lambda w, b: (fn(w, b), grad(w, b)))(0.7, b0)

    (value, g), (expected, e) = run(f), run(dense)
    assert_close(value, expected, 1e-6, "value")
    # the initial buffer's gradient survives where nothing was written (i = 1, 4, 6, 7)
    assert_close(g[1], e[1], 0.0, "gradient of the initial buffer")
    assert_close(g[0], e[0], 1e-6, "gradient of w")


def test_nested_loop_writes_the_enclosing_buffer():
    def f(w):
        def outer(s):
            i, h, out, k = s

            def inner(t):
                j, h, out, k = t
                h = jnp.sin(w * h)
                return j + 1, h, out.at[k].set(h), k + 1

            _, h, out, k = mw.while_loop(
                lambda t: t[0] <= i, inner, (0, h, out, k), checkpoints=2, buffers=lambda t: t[2]
            )
            return i + 1, h, out, k

        init = (0, 1.0, jnp.zeros(12), 0)
        return mw.while_loop(
            lambda s: s[0] < 4, outer, init, checkpoints=2, buffers=lambda s: s[2]
        )[2]

    def dense(w):
        h, out, k = 1.0, jnp.zeros(12), 0
        for i in range(4):
            for _ in range(i + 1):
                h = jnp.sin(w * h)
                out = out.at[k].set(h)
                k += 1
        return out

    weights = jnp.linspace(-1.0, 1.0, 12)

    def run(fn):  # value and gradient, one compiled program
        grad = jax.grad(lambda w: jnp.sum(fn(w) * weights))
        return jax.jit(lambda w: (fn(w), grad(w)))(0.9)

    (value, grad), (expected, expected_grad) = run(f), run(dense)
    assert_close(value, expected, 1e-6, "value")
    assert_close(grad, expected_grad, 1e-6, "gradient")


def test_integer_buffer_and_batched_condition():
    def f(w, limit):
        def body(s):
            i, h, hs, seen = s
            h = jnp.cos(w * h)
            return i + 1, h, hs.at[i].set(h), seen.at[i].set(i * i)

        init = (0, 1.0, jnp.zeros(8), jnp.zeros(8, jnp.int32))
        _, _, hs, seen = mw.while_loop(
            lambda s: s[0] < limit, body, init, checkpoints=2, buffers=lambda s: (s[2], s[3])
        )
        return jnp.sum(hs**2), seen

    def dense(w, limit):
        h, hs, seen = 1.0, jnp.zeros(8), jnp.zeros(8, jnp.int32)
        for i in range(limit):
            h = jnp.cos(w * h)
            hs, seen = hs.at[i].set(h), seen.at[i].set(i * i)
        return jnp.sum(hs**2), seen

    ws, limits = jnp.array([0.5, 1.2]), jnp.array([3, 7])
    # compiled (eager, each operation of the loops was compiled alone)
    (values, seen), grads = jax.jit(jax.vmap(jax.value_and_grad(f, has_aux=True)))(ws, limits)
    reference = jax.jit(jax.value_and_grad(dense, has_aux=True), static_argnums=1)
    for k in range(2):
        (value, seen_k), grad = reference(ws[k], int(limits[k]))
        assert_close(values[k], value, 1e-6, "value")
        assert_close(grads[k], grad, 1e-6, "gradient")
        assert (seen[k] == seen_k).all()


def test_buffer_is_not_checkpointed():
    """The buffer costs the same at 2 and 16 checkpoints; carried, it is stored per
    checkpoint (the compiled temporaries grow by about 14 buffers)."""
    rows = 4096

    def grad_fn(checkpoints, buffered):
        def loss(w):
            def body(s):
                i, h, hs = s
                h = jnp.tanh(w * h + 0.1)
                return i + 1, h, hs.at[i].set(h)

            init = (0, jnp.ones(4), jnp.zeros((rows, 4)))
            options = {"buffers": (lambda s: s[2])} if buffered else {}
            _, _, hs = mw.while_loop(
                lambda s: s[0] < 64, body, init, checkpoints=checkpoints, **options
            )
            return jnp.sum(hs**2)

        return jax.grad(loss)

    buffer_bytes = rows * 4 * 4
    temp = {
        (c, b): compiled_memory(grad_fn(c, b), 0.5).temp_bytes
        for c in (2, 16)
        for b in (True, False)
    }
    assert abs(temp[16, True] - temp[2, True]) < buffer_bytes // 4
    assert temp[16, False] - temp[2, False] > 10 * buffer_bytes


def test_a_jax_option_or_method_on_a_buffer_write_names_what_it_takes():
    # buffer.at[i].set(v, mode="drop"), as a jnp array takes it, raised Python's
    # "unexpected keyword argument" naming a private class.
    def run(write):
        def body(s):
            i, hs = s
            return i + 1, write(hs, i)

        init = (0, jnp.zeros((4, 2)))
        return mw.while_loop(lambda s: s[0] < 3, body, init, checkpoints=2, buffers=lambda s: s[1])

    with pytest.raises(TypeError, match=r"takes no \['mode'\].*pass pred=index < length"):
        run(lambda hs, i: hs.at[i].set(jnp.ones(2), mode="drop"))
    with pytest.raises(AttributeError, match=r"buffer.at\[...\].add does not exist"):
        run(lambda hs, i: hs.at[i].add(jnp.ones(2)))
