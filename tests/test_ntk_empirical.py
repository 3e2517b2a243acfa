"""Empirical NTK: the three methods against a dense jax.jacobian contraction."""

from __future__ import annotations

import math

import _draw
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _close import TOLERANCE, assert_dtype_close

from memwise import ntk
from memwise.measure import compiled_memory


def _mlp(params, x):
    h = jnp.tanh(x @ params["w"] + params["b"])
    return h @ params["v"]


def _params(key, d_in=3, width=8, d_out=4):
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "w": _draw.normal(k1, (d_in, width)) / math.sqrt(d_in),
        "b": _draw.normal(k2, (width,)),
        "v": _draw.normal(k3, (width, d_out)) / math.sqrt(width),
    }


def _dense_ntk(f, params, x1, x2):
    def flat_jacobian(x):
        jac = jax.jacobian(f)(params, x)  # leaves (n, *out, *leaf)
        n = x.shape[0]
        out = jax.eval_shape(f, params, x).shape[1:]
        return jnp.concatenate(
            [j.reshape(n, math.prod(out), -1) for j in jax.tree_util.tree_leaves(jac)], axis=-1
        ), out

    j1, out = flat_jacobian(x1)
    j2, _ = flat_jacobian(x2)
    full = jnp.einsum("aop,bqp->aboq", j1, j2)
    return full.reshape(full.shape[:2] + out + out)


@pytest.fixture(scope="module")
def problem():
    params = _params(jax.random.PRNGKey(0))
    x1 = _draw.normal(jax.random.PRNGKey(1), (7, 3))
    x2 = _draw.normal(jax.random.PRNGKey(2), (5, 3))
    return params, x1, x2, jax.jit(lambda p: _dense_ntk(_mlp, p, x1, x2))(params)


@pytest.mark.parametrize(
    "method, chunk_size", [("jacobian", (3, 2)), ("vjp", (3, 2)), ("vjp", 4), ("jacobian", (7, 5))]
)
@pytest.mark.slow
def test_blocks_match_dense_jacobian(problem, method, chunk_size):
    params, x1, x2, dense = problem
    fn = jax.jit(lambda p, a, b: ntk.empirical(_mlp, p, a, b, method=method, chunk_size=chunk_size))
    got = fn(params, x1, x2)
    assert got.shape == (7, 5, 4, 4)
    np.testing.assert_allclose(got, dense, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("method", ["jacobian", "vjp"])
def test_trace(problem, method):
    params, x1, x2, dense = problem
    got = jax.jit(
        lambda p: ntk.empirical(_mlp, p, x1, x2, method=method, chunk_size=(3, 2), trace=True)
    )(params)
    np.testing.assert_allclose(got, jnp.trace(dense, axis1=2, axis2=3), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_pseudo_ntk_is_gradient_of_logit_sum(problem):
    params, x1, x2, _ = problem
    scalar = lambda p, x: jnp.sum(_mlp(p, x), axis=1, keepdims=True) / 2.0  # sqrt(4 logits)
    expected = _dense_ntk(scalar, params, x1, x2)[..., 0, 0]
    got = jax.jit(lambda p: ntk.empirical(_mlp, p, x1, x2, method="pseudo", chunk_size=(3, 2)))(
        params
    )
    assert got.shape == (7, 5)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    # The pseudo-NTK is the sum of all O x O blocks of the NTK divided by O.
    full = jax.jit(lambda p: ntk.empirical(_mlp, p, x1, x2, method="jacobian", chunk_size=4))(
        params
    )
    np.testing.assert_allclose(got, jnp.sum(full, axis=(2, 3)) / 4, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_scalar_outputs_and_self_kernel():
    params = _params(jax.random.PRNGKey(3), d_out=1)
    f = lambda p, x: _mlp(p, x)[:, 0]
    x = _draw.normal(jax.random.PRNGKey(4), (6, 3))
    dense = _dense_ntk(lambda p, x: f(p, x)[:, None], params, x, x)[..., 0, 0]
    for method in ("jacobian", "vjp", "pseudo"):
        got = jax.jit(lambda p: ntk.empirical(f, p, x, method=method, chunk_size=4))(params)
        assert got.shape == (6, 6)
        np.testing.assert_allclose(got, dense, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_flax_model():
    import flax.linen as flax

    class Net(flax.Module):
        @flax.compact
        def __call__(self, x):
            return flax.Dense(3)(jnp.tanh(flax.Dense(6)(x)))

    model = Net()
    x = _draw.normal(jax.random.PRNGKey(5), (4, 2))
    variables = model.init(jax.random.PRNGKey(6), x)
    got = jax.jit(lambda v: ntk.empirical(model.apply, v, x, method="vjp", chunk_size=2))(variables)
    np.testing.assert_allclose(got, _dense_ntk(model.apply, variables, x, x), rtol=1e-4, atol=1e-5)


def test_bad_inputs(problem):
    params, x1, _, _ = problem
    with pytest.raises(ValueError, match="method"):
        ntk.empirical(_mlp, params, x1, method="exact")
    with pytest.raises(ValueError, match="same shape per input"):
        ntk.empirical(_mlp, params, x1, jnp.ones((2, 4)))
    with pytest.raises(ValueError, match="chunk_size"):
        ntk.empirical(_mlp, params, x1, chunk_size=0)
    with pytest.raises(ValueError, match="params has no arrays"):
        ntk.empirical(lambda p, x: x.sum(-1), {}, x1)


def test_temp_memory_is_one_tile():
    # Wide network, few inputs per tile: the Jacobians of a tile dominate, and the
    # compiled temp memory does not grow with the number of inputs (only the output does).
    params = _params(jax.random.PRNGKey(7), d_in=3, width=512, d_out=4)

    def temp(n):
        x = jax.ShapeDtypeStruct((n, 3), jnp.float32)
        fn = lambda p, x: ntk.empirical(_mlp, p, x, method="jacobian", chunk_size=(4, 4))
        return compiled_memory(fn, params, x).temp_bytes

    small, large = temp(16), temp(128)
    assert large <= 1.1 * small + 128 * 128 * 16 * 4, (small, large)
    jacobians_of_all = 128 * 4 * (3 * 512 + 512 + 512 * 4) * 4
    assert large < jacobians_of_all / 4


@pytest.mark.parametrize("method", ["jacobian", "vjp", "pseudo"])
def test_empty_inputs_give_an_empty_kernel(problem, method):
    params, x1, x2, _ = problem
    block = () if method == "pseudo" else (4, 4)
    for a, b in ((x1[:0], x2), (x1, x2[:0]), (x1[:0], None)):
        got = ntk.empirical(_mlp, params, a, b, method=method, chunk_size="auto")
        n2 = len(a) if b is None else len(b)
        assert got.shape == (len(a), n2) + block and got.dtype == jnp.float32
    assert ntk.empirical(_mlp, params, x1[:0], x2, method=method, trace=True).shape == (0, 5)


@pytest.mark.parametrize(
    "dtype, method, trace",
    [(dtype, "jacobian", False) for dtype in sorted(TOLERANCE["ntk_empirical"])]
    + [("bfloat16", "vjp", True), ("bfloat16", "pseudo", False)],
)
@pytest.mark.slow
def test_dtypes(dtype, method, trace):
    # Sums over the parameters accumulate in at least float32; the result keeps the dtype.
    cast = lambda t: jax.tree_util.tree_map(lambda a: np.asarray(a).astype(dtype), t)
    params = cast(_params(jax.random.PRNGKey(8), width=16))
    x1 = cast(_draw.normal(jax.random.PRNGKey(9), (5, 3)))
    x2 = cast(_draw.normal(jax.random.PRNGKey(10), (4, 3)))

    def dense(p, x1, x2):
        full = _dense_ntk(_mlp, p, x1, x2)
        if method == "pseudo":
            return jnp.sum(full, axis=(2, 3)) / 4
        return jnp.trace(full, axis1=2, axis2=3) if trace else full

    def kernel_and_sum(p):
        kernel = ntk.empirical(_mlp, p, x1, x2, method=method, chunk_size=(2, 3), trace=trace)
        return jnp.sum(kernel, dtype=jnp.float64 if dtype == "float64" else jnp.float32), kernel

    with jax.enable_x64(dtype == "float64"):
        (_, got), grads = jax.jit(jax.value_and_grad(kernel_and_sum, has_aux=True))(params)
    with jax.enable_x64(True):
        wide = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), (params, x1, x2))
        expected = dense(*wide)
        expected_grads = jax.grad(lambda p: jnp.sum(dense(p, *wide[1:])))(wide[0])
    assert got.dtype == jnp.dtype(dtype)
    assert_dtype_close("ntk_empirical", got, expected, dtype)
    for g, e in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(expected_grads)):
        assert g.dtype == jnp.dtype(dtype)
        assert_dtype_close("ntk_empirical", g, e, dtype)
