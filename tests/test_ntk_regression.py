"""Kernel regression and the KIP loss against dense JAX, and their flat gradient memory."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _close import assert_close

from memwise.measure import compiled_memory
from memwise.ntk import kernel_regression, kip_loss
from memwise.ntk import kernels as k

CONV = k.serial(k.Conv((3, 3)), k.Relu(), k.Conv((3, 3)), k.Relu(), k.Flatten(), k.Dense())
# One conv layer compiles several times faster than two; the memory argument is the same.
CONV1 = k.serial(k.Conv((3, 3)), k.Relu(), k.Flatten(), k.Dense())
FC = k.serial(
    k.Dense(W_std=1.5, b_std=0.05), k.Relu(), k.Dense(W_std=1.5, b_std=0.05), k.Erf(), k.Dense()
)


def _naive_predict(kernel_fn, x_train, y_train, x_test, ridge):
    k_train = kernel_fn(x_train, x_train)
    n = k_train.shape[0]
    reg = k_train + ridge * jnp.trace(k_train) / n * jnp.eye(n)
    return kernel_fn(x_test, x_train) @ jnp.linalg.solve(reg, y_train)


def _naive_kip(kernel_fn, xs, ys, xt, yt, ridge):
    # The loss of the KIP notebook (the KIP report's loss_fn), written densely.
    pred = _naive_predict(kernel_fn, xs, ys, xt, ridge)
    return 0.5 * jnp.mean((pred - yt) ** 2)


def _images(seed, n, side=6):
    # numpy data: no per-shape compilation of a random-number program.
    return jnp.asarray(np.random.default_rng(seed).normal(size=(n, side, side, 1)), jnp.float32)


def _labels(n, classes=3):
    return jax.nn.one_hot(jnp.arange(n) % classes, classes)


@pytest.mark.slow
def test_kernel_regression_matches_dense():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(11, 4)), jnp.float32)
    y = jnp.stack([jnp.sin(x[:, 0]), jnp.cos(x[:, 1])], axis=1)
    xt = jnp.asarray(np.random.default_rng(1).normal(size=(9, 4)), jnp.float32)
    fn = jax.jit(lambda x, y, xt: kernel_regression(FC, x, y, xt, ridge=1e-3, chunk_size=(4, 3)))
    np.testing.assert_allclose(
        fn(x, y, xt), _naive_predict(FC, x, y, xt, 1e-3), rtol=2e-4, atol=2e-5
    )


@pytest.mark.slow
def test_kernel_regression_vector_labels_and_nngp():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(11, 4)), jnp.float32)
    y = jnp.sin(x[:, 0])
    xt = jnp.asarray(np.random.default_rng(1).normal(size=(9, 4)), jnp.float32)
    vector = jax.jit(
        lambda x, y, xt: kernel_regression(FC, x, y, xt, ridge=1e-3, chunk_size=5, get="nngp")
    )(x, y, xt)
    expected = _naive_predict(lambda a, b: FC(a, b, get="nngp"), x, y, xt, 1e-3)
    assert vector.shape == (9,)
    np.testing.assert_allclose(vector, expected, rtol=2e-4, atol=2e-5)


@pytest.mark.slow
def test_kernel_regression_with_any_kernel_function():
    rbf = lambda a, b: jnp.exp(-jnp.sum((a[:, None] - b[None]) ** 2, -1))
    x = jnp.asarray(np.random.default_rng(2).normal(size=(10, 2)), jnp.float32)
    y = jnp.sin(x[:, :1])
    xt = jnp.asarray(np.random.default_rng(3).normal(size=(7, 2)), jnp.float32)
    got = kernel_regression(rbf, x, y, xt, ridge=1e-2, chunk_size=(3, 4))
    np.testing.assert_allclose(got, _naive_predict(rbf, x, y, xt, 1e-2), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "kernel_fn, chunk_size",
    [
        (CONV1, (4, 2)),
        pytest.param(CONV1, 5, marks=pytest.mark.slow),
        pytest.param(CONV, (13, 6), marks=pytest.mark.slow),
    ],
)
@pytest.mark.slow
def test_kip_loss_and_gradients_match_dense(kernel_fn, chunk_size):
    xs, xt = _images((4), 6), _images((5), 13)
    ys, yt = _labels(6), _labels(13)
    loss = lambda xs, ys: kip_loss(kernel_fn, xs, ys, xt, yt, ridge=1e-3, chunk_size=chunk_size)
    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(xs, ys)
    naive = lambda xs, ys: _naive_kip(kernel_fn, xs, ys, xt, yt, 1e-3)
    expected_value, expected_grads = jax.jit(jax.value_and_grad(naive, argnums=(0, 1)))(xs, ys)
    np.testing.assert_allclose(value, expected_value, rtol=1e-4)
    for got, expected in zip(grads, expected_grads):
        scale = float(jnp.max(jnp.abs(expected)))
        np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-4 * scale)


@pytest.mark.slow
def test_kip_gradient_reaches_ridge_and_targets():
    xs, xt = _images((6), 4), _images((7), 5)
    ys, yt = _labels(4), _labels(5)
    ours = jax.grad(
        lambda r, xt: kip_loss(CONV, xs, ys, xt, yt, ridge=r, chunk_size=(2, 3)), (0, 1)
    )
    dense = jax.grad(lambda r, xt: _naive_kip(CONV, xs, ys, xt, yt, r), (0, 1))
    for got, expected in zip(jax.jit(ours)(0.01, xt), jax.jit(dense)(0.01, xt)):
        np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-6)


def _kip_grad_temp(n_target: int, side: int = 8) -> int:
    s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    return compiled_memory(
        lambda xs, ys, xt, yt: kip_loss(CONV1, xs, ys, xt, yt, ridge=1e-6, chunk_size=(16, 4)),
        s(12, side, side, 1),
        s(12, 10),
        s(n_target, side, side, 1),
        s(n_target, 10),
        grad=True,
        argnums=(0, 1),
    ).temp_bytes


@pytest.mark.slow
def test_kip_gradient_memory_does_not_grow_with_targets():
    small, large = _kip_grad_temp(64), _kip_grad_temp(1024)
    assert large == pytest.approx(small, rel=0.02), (small, large)
    # The dense gradient holds (targets x support x pixels) tiles: far more already at 256.
    s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    naive = compiled_memory(
        lambda xs, ys, xt, yt: _naive_kip(CONV1, xs, ys, xt, yt, 1e-6),
        s(12, 8, 8, 1),
        s(12, 10),
        s(256, 8, 8, 1),
        s(256, 10),
        grad=True,
        argnums=(0, 1),
    ).temp_bytes
    assert naive > 4 * large, (naive, large)


def test_bad_inputs():
    xs, ys = _images((8), 4), _labels(4)
    xt, yt = _images((9), 5), _labels(5)
    with pytest.raises(ValueError, match="image shape"):
        kip_loss(CONV, xs, ys, _images((9), 5, side=7), yt, ridge=1e-3, chunk_size=2)
    with pytest.raises(ValueError, match="ridge must be >= 0"):
        kip_loss(CONV, xs, ys, xt, yt, ridge=-1e-3, chunk_size=2)
    with pytest.raises(ValueError, match="y_support has 4 rows|4 inputs but y_support has 3"):
        kip_loss(CONV, xs, ys[:3], xt, yt, ridge=1e-3, chunk_size=2)
    with pytest.raises(ValueError, match="outputs"):
        kip_loss(CONV, xs, ys, xt, yt[:, :2], ridge=1e-3, chunk_size=2)
    with pytest.raises(ValueError, match="chunk_size"):
        kip_loss(CONV, xs, ys, xt, yt, ridge=1e-3, chunk_size=(0, 2))
    with pytest.raises(ValueError, match="image shape"):
        kernel_regression(CONV, xs, ys, xt[:, :5], ridge=0.0, chunk_size=2)


@pytest.mark.slow
def test_auto_chunk_size_is_a_knob():
    from memwise import knobs

    x = jnp.asarray(np.random.default_rng(10).normal(size=(9, 4)), jnp.float32)
    y = jnp.sin(x[:, :2])
    xt = jnp.asarray(np.random.default_rng(11).normal(size=(7, 4)), jnp.float32)
    yt = jnp.cos(xt[:, :2])
    with knobs.recording() as recorded:
        value = jax.jit(lambda x, y: kip_loss(FC, x, y, xt, yt, ridge=1e-3, chunk_size="auto"))(
            x, y
        )
    assert [k.kind for k in recorded] == ["chunk_size"]
    np.testing.assert_allclose(value, _naive_kip(FC, x, y, xt, yt, 1e-3), rtol=1e-4)


@pytest.mark.slow
def test_zero_training_input_keeps_predictions_finite():
    # An all-zero input has zero variance without a bias (ReLU's 0/0); one such training
    # point made every prediction NaN.
    kernel_fn = k.serial(k.Dense(), k.Relu(), k.Dense())
    rng = np.random.default_rng(12)
    x = jnp.asarray(rng.normal(size=(7, 3)), jnp.float32).at[2].set(0.0)
    y, xt = jnp.sin(x[:, :2]), jnp.asarray(rng.normal(size=(5, 3)), jnp.float32).at[0].set(0.0)
    predict = lambda x: kernel_regression(kernel_fn, x, y, xt, ridge=1e-2, chunk_size=(2, 3))
    got = jax.jit(predict)(x)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, _naive_predict(kernel_fn, x, y, xt, 1e-2), rtol=1e-4, atol=1e-5)
    assert np.all(np.isfinite(jax.jit(jax.grad(lambda x: jnp.sum(predict(x))))(x)))


def test_empty_inputs():
    x, y = _images(13, 4), _labels(4)
    for labels in (y, y[:, 0]):
        pred = kernel_regression(CONV1, x, labels, x[:0], ridge=1e-3, chunk_size=2)
        assert pred.shape == (0,) + labels.shape[1:] and pred.dtype == jnp.float32
    with pytest.raises(ValueError, match="x_train has no inputs"):
        kernel_regression(CONV1, x[:0], y[:0], x, ridge=1e-3, chunk_size=2)
    with pytest.raises(ValueError, match="x_support has no inputs"):
        kip_loss(CONV1, x[:0], y[:0], x, y, ridge=1e-3, chunk_size=2)
    with pytest.raises(ValueError, match="x_target has no inputs"):
        kip_loss(CONV1, x, y, x[:0], y[:0], ridge=1e-3, chunk_size=2)


# Largest error relative to the reference's largest entry, against float64 on the same
# rounded inputs (the solve amplifies the kernel's own rounding).
TOLERANCE = {"float64": 1e-9, "float32": 3e-4, "float16": 1.5e-2, "bfloat16": 1e-1}


def _assert_close(got, expected, dtype):
    assert_close(got, expected, TOLERANCE[dtype], dtype)


@pytest.mark.parametrize("dtype", sorted(TOLERANCE))
@pytest.mark.slow
def test_dtypes(dtype):
    # JAX's Cholesky has no bfloat16/float16 kernel: the solve and the sums over the
    # training set run in at least float32, and results come back in the inputs' dtype.
    rng = np.random.default_rng(14)
    x, xt = rng.normal(size=(8, 4)), rng.normal(size=(6, 4))
    x, y, xt, yt = (a.astype(dtype) for a in (x, np.sin(x[:, :2]), xt, np.cos(xt[:, :2])))

    def values_and_grads(kip, predict, x, y):
        # kernel_regression's gradient runs the same solve and tile sums as kip_loss's;
        # its values are checked, its gradient is not compiled a second time.
        value, grads = jax.value_and_grad(kip, (0, 1))(x, y)
        return (value, predict(x, y), *grads)

    with jax.enable_x64(dtype == "float64"):
        got = jax.jit(
            lambda x, y: values_and_grads(
                lambda x, y: kip_loss(FC, x, y, xt, yt, ridge=0.1, chunk_size=(4, 3)),
                lambda x, y: kernel_regression(FC, x, y, xt, ridge=0.1, chunk_size=(4, 3)),
                x,
                y,
            )
        )(x, y)
    with jax.enable_x64(True):
        wide = lambda a: jnp.asarray(a, jnp.float64)
        expected = jax.jit(
            lambda x, y: values_and_grads(
                lambda x, y: _naive_kip(FC, x, y, wide(xt), wide(yt), 0.1),
                lambda x, y: _naive_predict(FC, x, y, wide(xt), 0.1),
                x,
                y,
            )
        )(wide(x), wide(y))
    for a, b in zip(got, expected):
        assert a.dtype == jnp.dtype(dtype)
        _assert_close(a, b, dtype)


# Pooling kernels (the KIP paper's Myrtle-style and residual architectures): each input's
# own variances need its pixel-by-pixel covariance, prepared in chunks inside the tiling.
MYRTLE = k.serial(
    k.Conv((3, 3)),
    k.Relu(),
    k.AvgPool((2, 2), (2, 2)),
    k.Conv((3, 3)),
    k.Relu(),
    k.AvgPool((2, 2), (2, 2)),
    k.Flatten(),
    k.Dense(),
)
RESNET = k.serial(
    k.Conv((3, 3), W_std=1.4, b_std=0.1),
    k.FanOut(2),
    k.parallel(k.Identity(), k.serial(k.Relu(), k.Conv((3, 3), W_std=1.4))),
    k.FanInSum(),
    k.Relu(),
    k.GlobalAvgPool(),
    k.Dense(),
)


@pytest.mark.parametrize(
    "kernel_fn", [MYRTLE, pytest.param(RESNET, marks=pytest.mark.slow)], ids=["myrtle", "resnet"]
)
@pytest.mark.slow
def test_kip_with_pooling_kernels_matches_dense(kernel_fn):
    xs, xt = _images(8, 4, side=4), _images(9, 7, side=4)
    ys, yt = _labels(4), _labels(7)
    loss = lambda xs, ys: kip_loss(kernel_fn, xs, ys, xt, yt, ridge=1e-3, chunk_size=(3, 2))
    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(xs, ys)
    naive = lambda xs, ys: _naive_kip(kernel_fn, xs, ys, xt, yt, 1e-3)
    expected_value, expected_grads = jax.jit(jax.value_and_grad(naive, argnums=(0, 1)))(xs, ys)
    np.testing.assert_allclose(value, expected_value, rtol=1e-4)
    for got, expected in zip(grads, expected_grads):
        scale = float(jnp.max(jnp.abs(expected)))
        np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-4 * scale)


@pytest.mark.slow
def test_kip_gradient_memory_with_pooling_does_not_grow_with_targets():
    # Targets are prepared (own pixel-by-pixel covariance) a few at a time, never as a
    # whole block of rows: memory flat from 40 to 640 targets with 20-target row tiles.
    def temp(n_target):
        s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
        return compiled_memory(
            lambda xs, ys, xt, yt: kip_loss(MYRTLE, xs, ys, xt, yt, ridge=1e-6, chunk_size=(20, 2)),
            s(8, 8, 8, 1),
            s(8, 10),
            s(n_target, 8, 8, 1),
            s(n_target, 10),
            grad=True,
            argnums=(0, 1),
        ).temp_bytes

    small, large = temp(40), temp(640)
    assert large == pytest.approx(small, rel=0.05), (small, large)
