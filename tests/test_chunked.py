"""Tests for memwise.chunked: chunked_map and chunked_sum against dense JAX, forward-mode
errors, low-precision totals, empty inputs, chunk_size errors, and memory flat in the
number of items (compiled, never run)."""

import _draw
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _close import assert_allclose
from _hypothesis import examples
from hypothesis import given, settings
from hypothesis import strategies as st

import memwise as mw
from memwise.measure import compiled_memory

pytestmark = pytest.mark.usefixtures("float64_module")


MiB = 2**20


def _close(a, b, dtype):
    tol = 1e-10 if dtype == jnp.float64 else 2e-4
    assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


# --------------------------------------------------------------------------------------
# Values and gradients equal dense


@settings(max_examples=examples(2))
@given(
    n=st.integers(1, 12), chunk=st.integers(1, 6), dtype=st.sampled_from([jnp.float32, jnp.float64])
)
@pytest.mark.slow
def test_chunked_map_and_sum_match_dense(n, chunk, dtype):
    xs = {"a": jnp.linspace(-1, 1, n * 3, dtype=dtype).reshape(n, 3), "i": jnp.arange(n)}
    W = jnp.eye(3, dtype=dtype) * 0.5 + 0.1

    def f(W):
        return lambda t: {"h": jnp.tanh(W @ t["a"]) * (t["i"] % 2 + 1), "s": jnp.sum(t["a"] ** 2)}

    def loss_map(xs, W):
        out = mw.chunked_map(f(W), xs, chunk_size=chunk)
        return jnp.sum(out["h"] ** 2) + jnp.sum(jnp.sin(out["s"]))

    def loss_sum(xs, W):
        out = mw.chunked_sum(f(W), xs, chunk_size=chunk)
        return jnp.sum(out["h"] ** 3) + jnp.sin(out["s"])

    def dense_map(xs, W):
        out = jax.vmap(f(W))(xs)
        return jnp.sum(out["h"] ** 2) + jnp.sum(jnp.sin(out["s"]))

    def dense_sum(xs, W):
        out = jax.tree.map(lambda a: jnp.sum(a, 0), jax.vmap(f(W))(xs))
        return jnp.sum(out["h"] ** 3) + jnp.sin(out["s"])

    for ours, dense in [(loss_map, dense_map), (loss_sum, dense_sum)]:
        _close(ours(xs, W), dense(xs, W), dtype)
        g1 = jax.grad(lambda a, W: ours({"a": a, "i": xs["i"]}, W), (0, 1))(xs["a"], W)
        g2 = jax.grad(lambda a, W: dense({"a": a, "i": xs["i"]}, W), (0, 1))(xs["a"], W)
        for a, b in zip(g1, g2):
            _close(a, b, dtype)


def test_forward_mode_raises_type_error():
    with pytest.raises(TypeError):
        jax.jvp(lambda x: mw.chunked_sum(jnp.sin, x, chunk_size=2), (jnp.ones(3),), (jnp.ones(3),))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("chunk_size", [8, 64, 1024])
@pytest.mark.slow
def test_low_precision_sums_accumulate_in_float32(dtype, chunk_size):
    # 65,536 uniform values (true sum 32,706): a bfloat16 running total stalled at 2,048
    # (chunks of 8), 16,384 (64), 32,768 (1,024).
    xs = _draw.uniform(jax.random.PRNGKey(0), (65_536,)).astype(dtype)
    ref = jnp.sum(xs.astype(jnp.float32))
    one_ulp = 2.0 ** -jnp.finfo(dtype).nmant  # relative: the result's own rounding
    total = mw.chunked_sum(lambda x: x, xs, chunk_size=chunk_size)
    assert total.dtype == dtype
    assert_allclose(np.float32(total), ref, rtol=one_ulp)
    # the gradient of a closed-over array sums one term per chunk
    w = jnp.asarray(1.0, dtype)
    grad = jax.grad(lambda w: mw.chunked_sum(lambda x: w * x, xs, chunk_size=chunk_size))(w)
    assert grad.dtype == dtype
    assert_allclose(np.float32(grad), ref, rtol=one_ulp)


def test_empty_xs_give_the_dense_result():
    f = lambda x: {"y": jnp.sin(x), "n": jnp.sum(x > 0)}  # noqa: E731
    empty = jnp.ones((0, 3))
    ys = mw.chunked_map(f, empty, chunk_size=4)
    dense = jax.vmap(f)(empty)
    assert jax.tree.map(jnp.shape, ys) == jax.tree.map(jnp.shape, dense)
    total = mw.chunked_sum(f, empty, chunk_size=4)
    for a, b in zip(
        jax.tree.leaves(total), jax.tree.leaves(jax.tree.map(lambda a: jnp.sum(a, 0), dense))
    ):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    w = jnp.ones(3)
    grads = jax.grad(
        lambda w, xs: jnp.sum(mw.chunked_sum(lambda x: w * x, xs, chunk_size=2)), (0, 1)
    )(w, empty)
    np.testing.assert_array_equal(grads[0], jnp.zeros(3))
    assert grads[1].shape == (0, 3)
    with pytest.raises(ValueError, match="f failed on one item"):
        mw.chunked_map(lambda x: x @ jnp.ones(4), empty, chunk_size=2)


@pytest.mark.parametrize("bad", [(2, 3), 1.5, True, 0, -1, "fast"])
def test_chunk_size_errors_offer_what_1d_accepts(bad):
    with pytest.raises(
        (TypeError, ValueError), match="chunk_size must be a positive int or 'auto'"
    ):
        mw.chunked_map(jnp.sin, jnp.ones(4), chunk_size=bad)
    with pytest.raises(
        (TypeError, ValueError), match="chunk_size must be a positive int or 'auto'"
    ):
        mw.chunked_sum(jnp.sin, jnp.ones(4), chunk_size=bad)


# --------------------------------------------------------------------------------------
# Memory: compiled, never run


def test_chunked_sum_gradient_memory_flat_in_n():
    W = jax.ShapeDtypeStruct((64, 64), jnp.float32)

    def loss(W, xs):
        return jnp.sum(
            mw.chunked_sum(lambda x: jnp.tanh(W @ jnp.tanh(W @ x)), xs, chunk_size=256) ** 2
        )

    temps = [
        compiled_memory(loss, W, jax.ShapeDtypeStruct((n, 64), jnp.float32), grad=True).temp_bytes
        for n in (4096, 32768)
    ]
    # lax.map-style reverse mode would keep 2 activations of (n, 64) per layer: 16 MiB at 32k.
    assert temps[1] - temps[0] < 64 * (32768 - 4096), temps


def test_image_shaped_xs_are_not_copied():
    # (n, 28, 28, 1) images: reshaping xs into chunks changed XLA's CPU layout and cost a
    # full copy of xs; chunks are sliced by index instead, so temp is flat in n.
    w = jnp.ones((784, 16))

    def loss(w, xs):
        return mw.chunked_sum(lambda x: jnp.sum(jnp.tanh(x.reshape(-1) @ w)), xs, chunk_size=500)

    temps = [
        compiled_memory(
            loss, w, jax.ShapeDtypeStruct((n, 28, 28, 1), jnp.float32), grad=True
        ).temp_bytes
        for n in (6_000, 60_000)
    ]
    assert temps[1] - temps[0] < 64 * 1024, temps


FORWARD_MODE = {
    "jvp": lambda f: lambda w: jax.jvp(f, (w,), (1.0,))[1],
    "jit of jvp": lambda f: jax.jit(lambda w: jax.jvp(f, (w,), (1.0,))[1]),
    "jacfwd": jax.jacfwd,
    "linearize": lambda f: lambda w: jax.linearize(f, w)[1](1.0),
}


@pytest.mark.parametrize("kind", ["map", "sum"])
@pytest.mark.parametrize("transform", sorted(FORWARD_MODE))
def test_forward_mode_raises_naming_lax_map(kind, transform):
    # JAX's "can't apply forward-mode autodiff (jvp) to a custom_vjp function" came
    # instead, naming neither the primitive nor what to use.
    xs = jnp.arange(5.0)
    prim = mw.chunked_map if kind == "map" else mw.chunked_sum

    def loss(w):
        return jnp.sum(prim(lambda x: jnp.sin(w * x), xs, chunk_size=2))

    with pytest.raises(TypeError, match="not forward mode.*jax.lax.map"):
        jax.block_until_ready(FORWARD_MODE[transform](loss)(0.3))
    # Forward-over-reverse still works.
    assert_allclose(jax.hessian(loss)(0.3), jnp.sum(-(xs**2) * jnp.sin(0.3 * xs)), rtol=1e-5)
