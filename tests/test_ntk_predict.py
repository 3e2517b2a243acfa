"""Closed-form predictions against neural-tangents' stored values and dense JAX."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _close import TOLERANCE, assert_dtype_close

from memwise import ntk
from memwise.ntk import kernels as k

REFERENCE = os.path.join(os.path.dirname(__file__), "data", "neural_tangents_more.npz")


def _kernel():  # the reference's fc_gelu network
    return k.serial(k.Dense(W_std=1.3, b_std=0.1), k.Gelu(), k.Dense())


@pytest.fixture(scope="module")
def reference():
    with np.load(REFERENCE) as data:
        return dict(data)


def _data(reference, dtype=None):
    arrays = (reference[key] for key in ("pred_x_train", "pred_y_train", "pred_x_test"))
    return tuple(jnp.asarray(a, dtype) for a in arrays)


@pytest.mark.parametrize("get", ["nngp", "ntk"])
@pytest.mark.parametrize("time", ["inf", "t10"])
@pytest.mark.slow
def test_matches_neural_tangents_gradient_descent_mse_ensemble(reference, get, time):
    # nt.predict.gradient_descent_mse_ensemble(kernel_fn, x_train, y_train, diag_reg=1e-3)
    # (t, x_test, get, compute_cov=True), in float64; ragged (2, 5) tiles.
    t = None if time == "inf" else 10.0
    with jax.enable_x64(True):
        x_train, y_train, x_test = _data(reference)
        fn = jax.jit(
            lambda a, b, c: ntk.predict(
                _kernel(), a, b, c, ridge=1e-3, t=t, get=get, compute_cov=True, chunk_size=(2, 5)
            )
        )
        mean, cov = fn(x_train, y_train, x_test)
        assert mean.dtype == cov.dtype == jnp.float64
        np.testing.assert_allclose(
            mean, reference[f"pred_{get}_{time}_mean"], rtol=1e-6, atol=1e-12
        )
        np.testing.assert_allclose(cov, reference[f"pred_{get}_{time}_cov"], rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("get", ["nngp", "ntk"])
def test_an_array_of_times_is_each_time_alone(reference, get):
    # One eigendecomposition and one pass of each kernel serve every time: the results
    # equal the scalar-time predictions, stacked in t's shape (a vector y_train too).
    x_train, y_train, x_test = _data(reference, jnp.float32)
    times = jnp.array([[0.0, 0.5, 3.0], [10.0, 40.0, 1e3]])
    for y in (y_train, y_train[:, 0]):
        fn = jax.jit(
            lambda t, y=y: ntk.predict(
                _kernel(),
                x_train,
                y,
                x_test,
                ridge=1e-3,
                t=t,
                get=get,
                compute_cov=True,
                chunk_size=(2, 5),
            )
        )
        mean, cov = fn(times)
        assert mean.shape == times.shape + (x_test.shape[0],) + y.shape[1:]
        assert cov.shape == times.shape + (x_test.shape[0],) * 2
        for i in np.ndindex(times.shape):
            m_i, c_i = fn(times[i])
            np.testing.assert_allclose(mean[i], m_i, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(cov[i], c_i, rtol=1e-5, atol=1e-6)
    mean, cov = fn(jnp.zeros((0,)))
    assert mean.shape == (0, x_test.shape[0]) and cov.shape == (0,) + (x_test.shape[0],) * 2


@pytest.mark.slow
def test_infinite_time_mean_is_kernel_regression(reference):
    x_train, y_train, x_test = _data(reference, jnp.float32)
    for get in ("ntk", "nngp"):
        mean = ntk.predict(
            _kernel(), x_train, y_train[:, 0], x_test, ridge=1e-3, get=get, chunk_size=4
        )
        expected = ntk.kernel_regression(
            _kernel(), x_train, y_train[:, 0], x_test, ridge=1e-3, get=get, chunk_size=4
        )
        assert mean.shape == (5,)
        np.testing.assert_allclose(mean, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_time_zero_is_the_prior_and_long_times_converge(reference):
    with jax.enable_x64(True):
        x_train, y_train, x_test = _data(reference)
        mean0, cov0 = _jit_predict(ridge=1e-3, t=0.0, compute_cov=True, chunk_size=3)(
            x_train, y_train, x_test
        )
        np.testing.assert_allclose(mean0, 0.0, atol=1e-14)
        np.testing.assert_allclose(cov0, _kernel()(x_test, get="nngp"), rtol=1e-12)
        late = _jit_predict(ridge=1e-3, t=1e9, compute_cov=True, chunk_size=3)(
            x_train, y_train, x_test
        )
        limit = _jit_predict(ridge=1e-3, compute_cov=True, chunk_size=3)(x_train, y_train, x_test)
        for a, b in zip(late, limit):
            np.testing.assert_allclose(a, b, rtol=1e-7, atol=1e-10)


def _jit_predict(**options):
    # One compiled program: op-by-op dispatch of the tiled loops is slow.
    return jax.jit(lambda a, b, c: ntk.predict(_kernel(), a, b, c, **options))


def _dense_mean(x_train, y_train, x_test, t):
    # The closed form written densely: Theta(x, X) V diag((1 - exp(-l t / N)) / l) V^T y.
    kernel_fn = _kernel()
    theta = kernel_fn(x_train)
    theta = theta + 1e-3 * jnp.trace(theta) / theta.shape[0] * jnp.eye(theta.shape[0])
    evals, evecs = jnp.linalg.eigh(theta)
    gain = -jnp.expm1(-evals * t / y_train.size) / evals
    return kernel_fn(x_test, x_train) @ (evecs @ (gain[:, None] * (evecs.T @ y_train)))


@pytest.mark.slow
def test_gradients_through_time_and_training_inputs_match_dense(reference):
    with jax.enable_x64(True):
        x_train, y_train, x_test = _data(reference)

        def loss(fn):
            return lambda x, t: jnp.sum(jnp.sin(fn(x, t)))

        tiled = loss(
            lambda x, t: ntk.predict(
                _kernel(), x, y_train, x_test, ridge=1e-3, t=t, chunk_size=(2, 5)
            )
        )
        dense = loss(lambda x, t: _dense_mean(x, y_train, x_test, t))
        got = jax.jit(jax.grad(tiled, argnums=(0, 1)))(x_train, 10.0)
        expected = jax.jit(jax.grad(dense, argnums=(0, 1)))(x_train, 10.0)
        for a, b in zip(got, expected):
            np.testing.assert_allclose(a, b, rtol=1e-7, atol=1e-10)
        rows = jax.jit(
            jax.vmap(
                lambda xt: ntk.predict(
                    _kernel(), x_train, y_train, xt[None], ridge=1e-3, t=10.0, chunk_size=3
                )[0]
            )
        )(x_test)
        np.testing.assert_allclose(rows, _dense_mean(x_train, y_train, x_test, 10.0), rtol=1e-9)


@pytest.mark.parametrize("dtype", sorted(TOLERANCE["ntk_predict"]))
@pytest.mark.slow
def test_dtypes(reference, dtype):
    # The solve and sums run in float32 for half-precision kernels; outputs keep the dtype.
    x_train, y_train, x_test = _data(reference, dtype)
    options = dict(ridge=1e-3, t=10.0, compute_cov=True, chunk_size=4)
    got = _jit_predict(**options)(x_train, y_train, x_test)
    with jax.enable_x64(True):
        wide = [jnp.asarray(a, jnp.float64) for a in (x_train, y_train, x_test)]
        expected = _jit_predict(**options)(*wide)
    for a, b in zip(got, expected):
        assert a.dtype == jnp.dtype(dtype)
        assert_dtype_close("ntk_predict", a, b, dtype)


def test_bad_inputs(reference):
    x_train, y_train, x_test = _data(reference, jnp.float32)
    call = lambda **kw: ntk.predict(
        _kernel(),
        x_train,
        y_train,
        x_test,  # noqa: E731
        **{"ridge": 1e-3, **kw},
    )
    with pytest.raises(ValueError, match="t must be >= 0"):
        call(t=-1.0)
    with pytest.raises(TypeError, match="t must be None"):
        call(t="10")
    with pytest.raises(ValueError, match="t must be >= 0"):
        call(t=jnp.array([1.0, -1.0]))
    with pytest.raises(ValueError, match="get must be 'ntk' or 'nngp'"):
        call(get="both")
    with pytest.raises(ValueError, match="ridge"):
        call(ridge=-1.0)
    with pytest.raises(TypeError, match="compute_cov"):
        call(compute_cov="yes")
    with pytest.raises(ValueError, match="x_test"):
        ntk.predict(_kernel(), x_train, y_train, x_test[:0], ridge=1e-3)
    with pytest.raises(ValueError, match="y_train"):
        ntk.predict(_kernel(), x_train, y_train[:3], x_test, ridge=1e-3)
