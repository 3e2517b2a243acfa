"""Tests for memwise.pairwise: pairwise_reduce against dense JAX in every reduction and
orientation, low-precision sums, empty inputs and NaN, input validation, and the
gradient's memory from compiled_memory at two sizes."""

import functools

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


def _dense(fn, x, y, reduce, weights=None, axis=1):
    m = jax.vmap(jax.vmap(fn, (None, 0)), (0, None))(x, y)
    if axis == 0:
        m = m.T
    if reduce == "sum":
        return m if weights is None else m * weights[None]
    return m if weights is None else m + weights[None]


def dense_reduce(fn, x, y, reduce, weights=None, axis=1):
    m = _dense(fn, x, y, reduce, weights, axis)
    return {
        "sum": lambda: jnp.sum(m, 1),
        "logsumexp": lambda: jax.nn.logsumexp(m, 1),
        "max": lambda: jnp.max(m, 1),
        "min": lambda: jnp.min(m, 1),
    }[reduce]()


def _close(a, b, dtype):
    tol = 1e-10 if dtype == jnp.float64 else 2e-4
    assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


@pytest.mark.parametrize("bad", [0, -3, (0, 4), (4, -1)])
def test_chunk_size_must_be_positive(bad):
    with pytest.raises(ValueError, match="chunk_size"):
        mw.pairwise_reduce(lambda a, b: a @ b, jnp.ones((4, 2)), jnp.ones((4, 2)), chunk_size=bad)
    if isinstance(bad, int):
        with pytest.raises(ValueError, match="chunk_size"):
            mw.chunked_map(jnp.sin, jnp.ones(4), chunk_size=bad)


def test_bad_inputs_have_clear_errors():
    x, y = jnp.ones((4, 3)), jnp.ones((5, 2))
    with pytest.raises(ValueError, match="trailing shapes"):
        mw.pairwise_reduce(lambda a, b: jnp.sum((a - b) ** 2), x, y, chunk_size=2)
    with pytest.raises(ValueError, match="reduce must be one of"):
        mw.pairwise_reduce(lambda a, b: a @ b, x, x, reduce="mean", chunk_size=2)
    with pytest.raises(ValueError, match="weights must have shape"):
        mw.pairwise_reduce(lambda a, b: a @ b, x, x, weights=jnp.ones(3), chunk_size=2)
    with pytest.raises(ValueError, match="axis"):
        mw.pairwise_reduce(lambda a, b: a @ b, x, x, axis=2, chunk_size=2)
    with pytest.raises(ValueError, match="leading lengths"):
        mw.chunked_sum(lambda t: t[0] + t[1], (jnp.ones(3), jnp.ones(4)), chunk_size=2)
    with pytest.raises(TypeError, match="chunk_size"):
        mw.chunked_sum(jnp.sin, jnp.ones(3), chunk_size=1.5)


# --------------------------------------------------------------------------------------
# pairwise_reduce: values and gradients equal dense


@settings(max_examples=examples(3))
@given(
    n=st.integers(1, 9),
    m=st.integers(1, 9),
    d=st.integers(1, 3),
    rows=st.integers(1, 5),
    cols=st.integers(1, 5),
    reduce=st.sampled_from(["sum", "logsumexp", "max", "min"]),
    axis=st.sampled_from([0, 1]),
    dtype=st.sampled_from([jnp.float32, jnp.float64]),
    weighted=st.booleans(),
    seed=st.integers(0, 2**16),
)
@pytest.mark.slow
def test_pairwise_matches_dense(n, m, d, rows, cols, reduce, axis, dtype, weighted, seed):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    x = _draw.normal(keys[0], (n, d), dtype)
    y = _draw.normal(keys[1], (m, d), dtype)
    scale = jnp.asarray(0.7, dtype)
    weighted = weighted and reduce in ("sum", "logsumexp")
    w = _draw.normal(keys[2], ((n if axis == 0 else m),), dtype) if weighted else None

    def ours(x, y, w, scale):
        return mw.pairwise_reduce(
            lambda a, b: -scale * jnp.sum((a - b) ** 2),
            x,
            y,
            reduce=reduce,
            weights=w,
            chunk_size=(rows, cols),
            axis=axis,
        )

    def dense(x, y, w, scale):
        return dense_reduce(lambda a, b: -scale * jnp.sum((a - b) ** 2), x, y, reduce, w, axis)

    argnums = (0, 1, 3) + ((2,) if weighted else ())
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))  # noqa: E731

    def run(f):  # value and gradients, one compiled program (eager, each operation of
        # the tile loops was compiled alone)
        return jax.jit(lambda *a: (f(*a), jax.grad(loss(f), argnums)(*a)))(x, y, w, scale)

    (value, grads), (ref, ref_grads) = run(ours), run(dense)
    _close(value, ref, dtype)
    for g1, g2 in zip(grads, ref_grads):
        _close(g1, g2, dtype)


@pytest.mark.slow
def test_pairwise_pytree_points_and_vector_weights():
    keys = jax.random.split(jax.random.PRNGKey(1), 4)
    x = {"p": _draw.normal(keys[0], (7, 2)), "s": _draw.uniform(keys[1], (7,))}
    y = {"p": _draw.normal(keys[2], (5, 2)), "s": jnp.linspace(0.5, 1.0, 5)}
    w = _draw.normal(keys[3], (5, 3))

    def kernel(a, b):
        return jnp.exp(-jnp.sum((a["p"] - b["p"]) ** 2) * a["s"] * b["s"])

    def ours(x, y, w):
        return mw.pairwise_reduce(kernel, x, y, weights=w, chunk_size=(3, 2))

    def dense(x, y, w):
        return jax.vmap(jax.vmap(kernel, (None, 0)), (0, None))(x, y) @ w

    loss = lambda f: lambda *a: jnp.sum(f(*a) ** 2)  # noqa: E731

    def run(f):  # value and gradients, one compiled program
        return jax.jit(lambda *a: (f(*a), jax.grad(loss(f), (0, 1, 2))(*a)))(x, y, w)

    (value, g1), (ref, g2) = run(ours), run(dense)
    assert value.shape == (7, 3)
    _close(value, ref, jnp.float64)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        _close(a, b, jnp.float64)


@pytest.mark.slow
def test_argmax_argmin_and_jit_vmap():
    x = _draw.normal(jax.random.PRNGKey(2), (3, 11, 2))
    y = _draw.normal(jax.random.PRNGKey(3), (9, 2))
    fn = lambda a, b: a @ b  # noqa: E731
    f = jax.jit(jax.vmap(lambda x: mw.pairwise_reduce(fn, x, y, reduce="argmax", chunk_size=4)))
    np.testing.assert_array_equal(f(x), jnp.argmax(x @ y.T, -1))
    am = mw.pairwise_reduce(fn, x[0], y, reduce="argmin", chunk_size=(4, 2))
    np.testing.assert_array_equal(am, jnp.argmin(x[0] @ y.T, -1))
    g = jax.vmap(
        jax.grad(lambda x: jnp.sum(mw.pairwise_reduce(fn, x, y, reduce="logsumexp", chunk_size=4)))
    )(x)
    g_dense = jax.vmap(jax.grad(lambda x: jnp.sum(jax.nn.logsumexp(x @ y.T, 1))))(x)
    _close(g, g_dense, jnp.float64)


@pytest.mark.slow
def test_logsumexp_masks_with_minus_inf_log_weights():
    x = _draw.normal(jax.random.PRNGKey(4), (6, 2))
    logw = jnp.array([0.0, -jnp.inf, 1.0, -jnp.inf, 0.5])
    y = _draw.normal(jax.random.PRNGKey(5), (5, 2))
    f = lambda x: mw.pairwise_reduce(
        lambda a, b: a @ b,
        x,
        y,
        reduce="logsumexp",  # noqa: E731
        weights=logw,
        chunk_size=2,
    )
    d = lambda x: jax.nn.logsumexp(x @ y.T + logw, 1)  # noqa: E731
    _close(f(x), d(x), jnp.float64)
    _close(jax.grad(lambda x: jnp.sum(f(x)))(x), jax.grad(lambda x: jnp.sum(d(x)))(x), jnp.float64)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("chunk_size", [8, 64, 1024])
@pytest.mark.slow
def test_low_precision_sums_accumulate_in_float32(dtype, chunk_size):
    # One point against 65,536 uniform values (true sum 32,706): a bfloat16 running sum
    # stalled at 2,048 (tiles of 8), 16,384 (64), 32,768 (1,024).
    y = _draw.uniform(jax.random.PRNGKey(0), (65_536,)).astype(dtype)
    x = jnp.ones((1,), dtype)
    ref = jnp.sum(y.astype(jnp.float32))
    one_ulp = 2.0 ** -jnp.finfo(dtype).nmant  # relative: the result's own rounding

    def total(x, y):
        return mw.pairwise_reduce(lambda a, b: a * b, x, y, chunk_size=(1, chunk_size))[0]

    out = total(x, y)
    assert out.dtype == dtype
    assert_allclose(np.float32(out), ref, rtol=one_ulp)
    # d/dx sums one term per column tile into the row's cotangent
    dx, dy = jax.grad(total, (0, 1))(x, y)
    assert dx.dtype == dtype
    assert_allclose(np.float32(dx[0]), ref, rtol=one_ulp)
    np.testing.assert_array_equal(dy, jnp.ones_like(y))


def test_empty_inputs_give_the_dense_result():
    fn = lambda a, b: a @ b  # noqa: E731
    none, three = jnp.ones((0, 2)), jnp.ones((3, 2))
    # no kept points: empty results
    for reduce in ("sum", "logsumexp", "max", "argmin"):
        out = mw.pairwise_reduce(fn, none, three, reduce=reduce, chunk_size=2)
        assert out.shape == (0,)
        assert out.dtype == (jnp.int32 if reduce == "argmin" else none.dtype)
    # nothing to reduce over: the identity of the reduction, gradients zero
    w = jnp.ones((0, 4))
    np.testing.assert_array_equal(
        mw.pairwise_reduce(fn, three, none, weights=w, chunk_size=2), jnp.zeros((3, 4))
    )
    lse = lambda x, y: mw.pairwise_reduce(fn, x, y, reduce="logsumexp", chunk_size=2)  # noqa: E731
    np.testing.assert_array_equal(lse(three, none), jnp.full(3, -jnp.inf))
    np.testing.assert_array_equal(lse(three, none), jax.nn.logsumexp(three @ none.T, 1))
    gx, gy = jax.grad(lambda x, y: jnp.sum(jnp.exp(lse(x, y))), (0, 1))(three, none)
    np.testing.assert_array_equal(gx, jnp.zeros((3, 2)))
    assert gy.shape == (0, 2)
    # ... which the max family does not have (jnp.max raises too)
    for reduce in ("max", "argmax"):
        with pytest.raises(ValueError, match="zero points of y"):
            mw.pairwise_reduce(fn, three, none, reduce=reduce, chunk_size=2)
    with pytest.raises(ValueError, match="zero points of x"):
        mw.pairwise_reduce(fn, none, three, reduce="min", axis=0, chunk_size=2)
    with pytest.raises(ValueError, match="chunk_size"):
        mw.pairwise_reduce(fn, none, three, chunk_size=0)


@pytest.mark.slow
def test_nan_propagates_like_jnp():
    s = jnp.array([[1.0, jnp.nan, 3.0, jnp.nan, 5.0], [1.0, 2.0, 3.0, 4.0, 0.0]])
    fn = lambda i, j: s[i, j]  # noqa: E731
    rows, cols = jnp.arange(2), jnp.arange(5)
    for reduce in ("max", "min", "argmax", "argmin"):
        out = mw.pairwise_reduce(fn, rows, cols, reduce=reduce, chunk_size=(1, 2))
        np.testing.assert_array_equal(out, getattr(jnp, reduce)(s, 1))
        out = mw.pairwise_reduce(fn, rows, cols, reduce=reduce, chunk_size=(2, 1), axis=0)
        np.testing.assert_array_equal(out, getattr(jnp, reduce)(s, 0))


# --------------------------------------------------------------------------------------
# Memory: compiled, never run


def _lse_loss(x, y, chunk_size):
    # the XLA tiles' memory (on a TPU the default is the pair function's kernel:
    # tests/test_pair_function_kernel.py states its memory)
    return jnp.sum(
        mw.pairwise_reduce(
            lambda a, b: -jnp.sum((a - b) ** 2),
            x,
            y,
            reduce="logsumexp",
            chunk_size=chunk_size,
            implementation="xla",
        )
    )


@pytest.mark.parametrize("chunk_size", ["auto", (1024, 1024)])
@pytest.mark.slow
def test_gradient_memory_is_tiled_at_20k(chunk_size):
    f = functools.partial(_lse_loss, chunk_size=chunk_size)
    temps = {}
    for n in (20_000, 40_000):
        pts = jax.ShapeDtypeStruct((n, 2), jnp.float32)
        fwd = compiled_memory(f, pts, pts)
        grad = compiled_memory(f, pts, pts, grad=True, argnums=(0, 1))
        temps[n] = grad.temp_bytes
        assert grad.temp_bytes <= 2 * fwd.temp_bytes, (n, fwd, grad)
        assert grad.temp_bytes < 64 * MiB
    # Doubling n adds only O(n) vectors (padded points, per-row results), never a tile row:
    # a dense f32 20k x 20k matrix would be 1,526 MiB.
    assert temps[40_000] - temps[20_000] < 100 * 20_000


FORWARD_MODE = {
    "jvp": lambda f: lambda w: jax.jvp(f, (w,), (1.0,))[1],
    "jit of jvp": lambda f: jax.jit(lambda w: jax.jvp(f, (w,), (1.0,))[1]),
    "jacfwd": jax.jacfwd,
    "linearize": lambda f: lambda w: jax.linearize(f, w)[1](1.0),
}


@pytest.mark.parametrize("transform", sorted(FORWARD_MODE))
def test_forward_mode_raises_naming_pairwise_reduce(transform):
    # JAX's "can't apply forward-mode autodiff (jvp) to a custom_vjp function" came instead.
    xs = jnp.linspace(0.0, 1.0, 5)

    def loss(w):
        return mw.pairwise_reduce(lambda a, b: jnp.sin(w * a * b), xs, xs, chunk_size=2).sum()

    def dense(w):
        return jnp.sin(w * xs[:, None] * xs[None, :]).sum()

    with pytest.raises(TypeError, match="memwise.pairwise_reduce.*not forward mode"):
        jax.block_until_ready(FORWARD_MODE[transform](loss)(0.3))
    # compiled (eager, each operation of the tile loop and its derivatives was compiled
    # alone); the same program in every case, a hit of the persistent cache after the first
    assert_allclose(jax.jit(jax.hessian(loss))(0.3), jax.jit(jax.hessian(dense))(0.3), rtol=1e-5)


@pytest.mark.parametrize("transform", sorted(FORWARD_MODE))
def test_forward_mode_of_an_arg_extreme_is_zero(transform):
    # An index has no derivative: eager jvp raised JAX's custom_vjp error while jit of
    # jvp gave the right answer.
    xs = jnp.linspace(0.0, 1.0, 5)

    def loss(w):
        index = mw.pairwise_reduce(lambda a, b: -((w * a - b) ** 2), xs, xs, reduce="argmax")
        return w * jnp.sum(index)

    expected = jnp.sum(jnp.argmax(-((0.3 * xs[:, None] - xs[None, :]) ** 2), axis=1))
    assert_allclose(FORWARD_MODE[transform](loss)(0.3), expected)
