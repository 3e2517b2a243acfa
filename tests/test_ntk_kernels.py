"""Infinite-width kernels against neural-tangents' values (tests/data) and each other."""

from __future__ import annotations

import os

import _draw
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _close import TOLERANCE, assert_dtype_close
from jax import lax
from jax.test_util import check_grads

from memwise.measure import compiled_memory
from memwise.ntk import kernels as k


def _jit(kernel_fn, get=("nngp", "ntk")):
    # One compiled program per kernel: op-by-op dispatch of the layer recursion is slow.
    return jax.jit(lambda x1, x2=None: kernel_fn(x1, x2, get=get))


REFERENCE = os.path.join(os.path.dirname(__file__), "data", "neural_tangents_kernels.npz")

ARCHITECTURES = {
    "conv_relu2_flatten": lambda: k.serial(
        k.Conv((3, 3)), k.Relu(), k.Conv((3, 3)), k.Relu(), k.Flatten(), k.Dense()
    ),
    "conv_relu_gap": lambda: k.serial(k.Conv((3, 3)), k.Relu(), k.GlobalAvgPool(), k.Dense()),
    "fc_relu_erf": lambda: k.serial(
        k.Dense(W_std=1.5, b_std=0.05), k.Relu(), k.Dense(W_std=1.5, b_std=0.05), k.Erf(), k.Dense()
    ),
}


@pytest.fixture(scope="module")
def reference():
    # Kernels computed by neural-tangents 0.6.5 on jax 0.4.30 in float64 (see
    # data/neural_tangents_kernels.README.md).
    with np.load(REFERENCE) as data:  # closed: an open NpzFile warns when collected
        return dict(data)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_matches_neural_tangents_in_float64(reference, name):
    prefix = "fc" if name.startswith("fc") else "conv"
    x1, x2 = reference[f"{prefix}_x1"], reference[f"{prefix}_x2"]
    with jax.enable_x64(True):
        kernel_fn = ARCHITECTURES[name]()
        nngp, ntk = _jit(kernel_fn)(jnp.asarray(x1), jnp.asarray(x2))
        assert nngp.dtype == jnp.float64
        np.testing.assert_allclose(nngp, reference[f"{name}_nngp"], rtol=1e-6, atol=0)
        np.testing.assert_allclose(ntk, reference[f"{name}_ntk"], rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
@pytest.mark.slow
def test_self_kernel_is_symmetric_and_equals_cross(reference, name):
    prefix = "fc" if name.startswith("fc") else "conv"
    x1 = jnp.asarray(reference[f"{prefix}_x1"], jnp.float32)
    kernel_fn = ARCHITECTURES[name]()
    own = _jit(kernel_fn, "ntk")(x1)
    cross = _jit(kernel_fn, "ntk")(x1, x1)
    np.testing.assert_allclose(own, own.T, rtol=1e-5)
    np.testing.assert_allclose(own, cross, rtol=1e-5)
    assert np.all(np.linalg.eigvalsh(np.asarray(own, np.float64)) > -1e-4 * float(jnp.max(own)))


def _forced_full(*layers):
    # A GlobalAvgPool after Flatten is a no-op on values but makes every earlier layer use
    # the pixel-by-pixel covariance: the full code path must give the diagonal one's values.
    return k.serial(*layers, k.GlobalAvgPool())


@pytest.mark.parametrize(
    "conv",
    [
        dict(filter_shape=(3, 3)),
        dict(filter_shape=(3, 2), strides=(2, 1), padding="SAME", b_std=0.3),
        dict(filter_shape=(2, 3), strides=(2, 2), padding="VALID", W_std=1.3),
    ],
)
@pytest.mark.slow
def test_full_and_diagonal_covariances_agree(conv):
    x1 = _draw.normal(jax.random.PRNGKey(0), (3, 7, 6, 2))
    x2 = _draw.normal(jax.random.PRNGKey(1), (2, 7, 6, 2))
    layers = (
        k.Conv(**conv),
        k.Relu(),
        k.Conv((2, 2), padding="VALID"),
        k.Erf(),
        k.Flatten(),
        k.Dense(),
    )
    diag = _jit(k.serial(*layers))(x1, x2)
    full = _jit(_forced_full(*layers))(x1, x2)
    for a, b in zip(diag, full):
        np.testing.assert_allclose(a, b, rtol=2e-5)


@pytest.mark.slow
def test_conv_window_matches_reduce_window():
    # One conv layer: nngp = W^2 * (mean over the window of the per-pixel input
    # covariance), zero padding included; checked against XLA's windowed average.
    x1 = _draw.normal(jax.random.PRNGKey(2), (2, 9, 8, 3))
    x2 = _draw.normal(jax.random.PRNGKey(3), (4, 9, 8, 3))
    for strides, padding in [((1, 1), "SAME"), ((2, 3), "SAME"), ((2, 2), "VALID")]:
        kernel_fn = k.serial(k.Conv((3, 2), strides=strides, padding=padding, W_std=2.0))
        got = _jit(kernel_fn, "nngp")(x1, x2)

        @jax.jit
        def expected(x1, x2):
            cov = jnp.einsum("ahwc,bhwc->abhw", x1, x2) / 3
            window = (1, 1, 3, 2)
            return 4.0 * lax.reduce_window(cov, 0.0, lax.add, window, (1, 1) + strides, padding) / 6

        np.testing.assert_allclose(got, expected(x1, x2), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_gradient_is_finite_on_the_diagonal():
    # theta = 0 on the diagonal of a self-kernel: sqrt(1 - cos^2) must not give inf/nan.
    kernel_fn = ARCHITECTURES["conv_relu2_flatten"]()
    x = _draw.normal(jax.random.PRNGKey(4), (3, 4, 4, 1))
    grad = jax.jit(jax.grad(lambda x: jnp.sum(kernel_fn(x))))(x)
    assert np.all(np.isfinite(grad))
    with jax.enable_x64(True):
        x64 = jnp.asarray(x, jnp.float64)
        check_grads(jax.jit(lambda x: kernel_fn(x, x64[:2] + 0.5)), (x64,), order=1, modes=["rev"])


def test_flatten_readout_keeps_covariances_diagonal():
    # The conv/flatten kernel holds one number per pixel and pair; the same network
    # through the pixel-by-pixel path holds (pixels)^2 per pair, 144x more at 12x12.
    layers = (k.Conv((3, 3)), k.Relu(), k.Conv((3, 3)), k.Relu(), k.Flatten(), k.Dense())
    x = jax.ShapeDtypeStruct((8, 12, 12, 1), jnp.float32)
    diagonal = compiled_memory(k.serial(*layers), x)
    full = compiled_memory(_forced_full(*layers), x)
    pixel_tile = 8 * 8 * 12 * 12 * 4
    assert diagonal.temp_bytes <= 12 * pixel_tile
    assert full.temp_bytes > 20 * diagonal.temp_bytes


def test_bad_inputs():
    kernel_fn = ARCHITECTURES["conv_relu2_flatten"]()
    with pytest.raises(ValueError, match="same shape per input"):
        kernel_fn(jnp.ones((2, 6, 6, 1)), jnp.ones((2, 5, 6, 1)))
    with pytest.raises(ValueError, match="get must be"):
        kernel_fn(jnp.ones((2, 6, 6, 1)), get="nntk")
    with pytest.raises(TypeError, match="serial"):
        k.serial(k.Relu(), "dense")
    with pytest.raises(ValueError, match="padding"):
        k.Conv((3, 3), padding="FULL")
    with pytest.raises(ValueError, match="pixel axes"):
        k.serial(k.Conv((3, 3)))(jnp.ones((2, 6, 1)))
    with pytest.raises(TypeError, match="float"):
        kernel_fn(jnp.ones((2, 6, 6, 1), jnp.int32))


def test_composes_with_jit_and_vmap():
    kernel_fn = ARCHITECTURES["fc_relu_erf"]()
    x = _draw.normal(jax.random.PRNGKey(5), (4, 5))
    y = _draw.normal(jax.random.PRNGKey(6), (3, 5))
    expected = jax.jit(kernel_fn)(x, y)
    rows = jax.jit(jax.vmap(lambda xi: kernel_fn(xi[None], y)[0]))(x)
    np.testing.assert_allclose(rows, expected, rtol=1e-5)


NO_BIAS = {
    "conv_relu2_flatten": ARCHITECTURES["conv_relu2_flatten"],
    "conv_relu_gap": ARCHITECTURES["conv_relu_gap"],
    "fc_relu_erf_relu": lambda: k.serial(
        k.Dense(), k.Relu(), k.Dense(W_std=1.5), k.Erf(), k.Dense(), k.Relu(), k.Dense()
    ),
}


@pytest.mark.parametrize("name", sorted(NO_BIAS))
@pytest.mark.slow
def test_zero_inputs_give_the_limit_of_vanishing_inputs(name):
    # Without a bias an all-zero input (or a pixel whose receptive field is all zero) has
    # zero variance, and ReLU's cos = cov / sqrt(var1 var2) is 0/0. The kernel is the
    # limit of the input scaled by t -> 0: finite, and so are its gradients.
    rng = np.random.default_rng(7)
    shape = (4, 6, 6, 2) if name.startswith("conv") else (4, 5)
    x, scaled = rng.normal(size=shape), rng.normal(size=shape)
    zero = x.copy()
    zero[0] = 0.0
    scaled[1:] = x[1:]
    scaled[0] *= 1e-6
    if name.startswith("conv"):  # half an image zero: zero variance at some pixels only
        zero[1, :, :3] = 0.0
        scaled[1, :, :3] = 1e-6 * rng.normal(size=scaled[1, :, :3].shape)
    with jax.enable_x64(True):
        kernel_fn = _jit(NO_BIAS[name]())
        other = jnp.asarray(rng.normal(size=(3,) + shape[1:]))
        for x2 in (None, other):
            got = kernel_fn(jnp.asarray(zero), x2)
            limit = kernel_fn(jnp.asarray(scaled), x2)
            for a, b in zip(got, limit):
                assert np.all(np.isfinite(a))
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(jnp.max(b)))
    grad = jax.jit(jax.grad(lambda x: sum(map(jnp.sum, kernel_fn(x, x[::-1])))))
    assert np.all(np.isfinite(grad(jnp.asarray(zero, jnp.float32))))


@pytest.mark.parametrize("dtype", sorted(TOLERANCE["ntk_kernels"]))
@pytest.mark.parametrize("name", ["conv_relu_gap", "fc_relu_erf", "fc_gelu"])
@pytest.mark.slow
def test_dtypes(name, dtype):
    # Sums over channels and conv windows accumulate in at least float32; kernels and
    # gradients keep the inputs' dtype.
    kernel_fn = {**ARCHITECTURES, **MORE_ARCHITECTURES}[name]()
    shape = (4, 5, 5, 2) if name.startswith("conv") else (4, 5)
    rng = np.random.default_rng(11)
    x1, x2 = (rng.normal(size=(n,) + shape[1:]).astype(dtype) for n in (4, 3))

    def kernels_and_sum(x1, x2):
        kernels = kernel_fn(x1, x2, get=("nngp", "ntk"))
        return sum(
            jnp.sum(a, dtype=jnp.promote_types(a.dtype, jnp.float32)) for a in kernels
        ), kernels

    with jax.enable_x64(dtype == "float64"):
        (_, got), grad = jax.jit(jax.value_and_grad(kernels_and_sum, has_aux=True))(x1, x2)
    with jax.enable_x64(True):
        wide = [jnp.asarray(a, jnp.float64) for a in (x1, x2)]
        (_, expected), expected_grad = jax.jit(jax.value_and_grad(kernels_and_sum, has_aux=True))(
            *wide
        )
    for a, b in zip(got + (grad,), expected + (expected_grad,)):
        assert a.dtype == jnp.dtype(dtype)
        assert_dtype_close("ntk_kernels", a, b, dtype)


# ----------------------------------------------------------------------------------------
# More layers: pooling (Myrtle), residual networks, strided VALID convs, activations,
# LayerNorm, against neural-tangents 0.6.5 (data/neural_tangents_more.README.md).

MORE_REFERENCE = os.path.join(os.path.dirname(__file__), "data", "neural_tangents_more.npz")


def _fc(activation):
    return k.serial(k.Dense(W_std=1.3, b_std=0.1), activation, k.Dense())


def _myrtle():
    return k.serial(
        k.Conv((3, 3)),
        k.Relu(),
        k.Conv((3, 3)),
        k.Relu(),
        k.AvgPool((2, 2), strides=(2, 2)),
        k.Conv((3, 3)),
        k.Relu(),
        k.AvgPool((2, 2), strides=(2, 2)),
        k.Flatten(),
        k.Dense(),
    )


def _resnet():
    block = k.parallel(k.Identity(), k.serial(k.Relu(), k.Conv((3, 3), W_std=1.4)))
    return k.serial(
        k.Conv((3, 3), W_std=1.4, b_std=0.1),
        k.FanOut(2),
        block,
        k.FanInSum(),
        k.Relu(),
        k.GlobalAvgPool(),
        k.Dense(),
    )


MORE_ARCHITECTURES = {
    "myrtle": _myrtle,
    "resnet": _resnet,
    "conv_valid_stride": lambda: k.serial(
        k.Conv((3, 3), strides=(2, 2), padding="VALID"), k.Relu(), k.Flatten(), k.Dense()
    ),
    "fc_gelu": lambda: _fc(k.Gelu()),
    "fc_sigmoid_like": lambda: _fc(k.Sigmoid_like()),
    "fc_leaky_relu": lambda: _fc(k.LeakyRelu(0.1)),
    "fc_abrelu": lambda: _fc(k.ABRelu(-0.5, 1.5)),
    "fc_sin": lambda: _fc(k.Sin(a=1, b=2, c=0.3)),
    "fc_abs": lambda: _fc(k.Abs()),
    "fc_layernorm": lambda: k.serial(
        k.Dense(W_std=1.3, b_std=0.1), k.LayerNorm(), k.Relu(), k.Dense()
    ),
    "fc_deep_erf": lambda: k.serial(
        *[layer for _ in range(4) for layer in (k.Dense(W_std=1.5, b_std=0.05), k.Erf())],
        k.Dense(),
    ),
}


@pytest.fixture(scope="module")
def more_reference():
    with np.load(MORE_REFERENCE) as data:
        return dict(data)


def _inputs(reference, name):
    prefix = "fc" if name.startswith("fc") else "img"
    return reference[f"{prefix}_x1"], reference[f"{prefix}_x2"]


@pytest.mark.parametrize("name", sorted(MORE_ARCHITECTURES))
@pytest.mark.slow
def test_more_layers_match_neural_tangents_in_float64(more_reference, name):
    x1, x2 = _inputs(more_reference, name)
    with jax.enable_x64(True):
        nngp, ntk = _jit(MORE_ARCHITECTURES[name]())(jnp.asarray(x1), jnp.asarray(x2))
        assert nngp.dtype == jnp.float64
        np.testing.assert_allclose(nngp, more_reference[f"{name}_nngp"], rtol=1e-6, atol=0)
        np.testing.assert_allclose(ntk, more_reference[f"{name}_ntk"], rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", ["myrtle", "resnet", "fc_gelu", "fc_sin", "fc_layernorm"])
@pytest.mark.slow
def test_more_layers_self_kernel_is_symmetric_psd_and_equals_cross(more_reference, name):
    x1 = jnp.asarray(_inputs(more_reference, name)[0], jnp.float32)
    kernel_fn = MORE_ARCHITECTURES[name]()
    own_nngp, own_ntk = _jit(kernel_fn)(x1)
    cross_nngp, cross_ntk = _jit(kernel_fn)(x1, x1)
    for own, cross in ((own_nngp, cross_nngp), (own_ntk, cross_ntk)):
        np.testing.assert_allclose(own, own.T, rtol=1e-5)
        np.testing.assert_allclose(own, cross, rtol=1e-5)
        assert np.all(np.linalg.eigvalsh(np.asarray(own, np.float64)) > -1e-4 * float(jnp.max(own)))


@pytest.mark.slow
def test_pooling_over_the_whole_image_is_global_average_pooling():
    x1 = _draw.normal(jax.random.PRNGKey(20), (3, 6, 5, 2))
    x2 = _draw.normal(jax.random.PRNGKey(21), (2, 6, 5, 2))
    head = (k.Conv((3, 3), b_std=0.2), k.Gelu(), k.Conv((2, 2), strides=(2, 1)), k.Relu())
    pooled = _jit(k.serial(*head, k.AvgPool((3, 5)), k.Flatten(), k.Dense()))(x1, x2)
    global_ = _jit(k.serial(*head, k.GlobalAvgPool(), k.Dense()))(x1, x2)
    for a, b in zip(pooled, global_):
        np.testing.assert_allclose(a, b, rtol=1e-5)


@pytest.mark.slow
def test_pooling_a_single_pixel_keeps_the_kernel():
    # AvgPool((1, 1)) changes no value but makes every earlier layer pixel-by-pixel; after
    # the last pool the covariance is per-pixel again.
    x1 = _draw.normal(jax.random.PRNGKey(22), (3, 5, 5, 2))
    x2 = _draw.normal(jax.random.PRNGKey(23), (2, 5, 5, 2))
    layers = (k.Conv((3, 3)), k.LeakyRelu(0.2), k.Conv((3, 3), strides=(2, 2)), k.LayerNorm())
    tail = (k.Conv((2, 2)), k.Sin(b=0.5), k.Flatten(), k.Dense())
    plain = _jit(k.serial(*layers, *tail))(x1, x2)
    pooled = _jit(k.serial(*layers, k.AvgPool((1, 1)), *tail))(x1, x2)
    for a, b in zip(plain, pooled):
        np.testing.assert_allclose(a, b, rtol=1e-5)


@pytest.mark.slow
def test_residual_branches_add_their_kernels():
    # FanOut + parallel + FanInSum adds the branches' kernels (neural-tangents'
    # convention for independent branches), wherever the branches pool.
    x1 = _draw.normal(jax.random.PRNGKey(24), (3, 6, 6, 2))
    x2 = _draw.normal(jax.random.PRNGKey(25), (2, 6, 6, 2))
    stem = k.Conv((3, 3), b_std=0.1)
    branch_a = k.serial(k.Relu(), k.Conv((3, 3)), k.AvgPool((2, 2), (2, 2)))
    branch_b = k.serial(k.Erf(), k.Conv((2, 2), strides=(2, 2), padding="VALID"))
    joined = _jit(
        k.serial(stem, k.FanOut(2), k.parallel(branch_a, branch_b), k.FanInSum()), "nngp"
    )(x1, x2)
    a = _jit(k.serial(stem, branch_a), "nngp")(x1, x2)
    b = _jit(k.serial(stem, branch_b), "nngp")(x1, x2)
    np.testing.assert_allclose(joined, a + b, rtol=1e-5)


def test_more_layers_bad_inputs():
    x = jnp.ones((2, 6, 6, 1))
    with pytest.raises(ValueError, match="FanOut"):
        k.serial(k.Conv((3, 3)), k.parallel(k.Identity(), k.Relu()))(x)
    with pytest.raises(ValueError, match="FanInSum"):
        k.serial(k.Conv((3, 3)), k.FanOut(2), k.Relu())(x)
    with pytest.raises(ValueError, match="FanInSum"):
        k.serial(k.Conv((3, 3)), k.FanOut(2))(x)
    with pytest.raises(ValueError, match="joins branches"):
        k.serial(k.Conv((3, 3)), k.FanInSum())(x)
    with pytest.raises(ValueError, match="same pixel shape"):
        k.serial(
            k.FanOut(2), k.parallel(k.Identity(), k.Conv((3, 3), strides=(2, 2))), k.FanInSum()
        )(x)
    with pytest.raises(ValueError, match="pixel axes"):
        k.serial(k.Dense(), k.AvgPool((2, 2)))(jnp.ones((2, 5)))
    with pytest.raises(ValueError, match="strides"):
        k.AvgPool((2, 2), strides=(2,))
    with pytest.raises(ValueError, match="padding"):
        k.AvgPool((2, 2), padding="CIRCULAR")
    with pytest.raises(ValueError, match="FanOut n"):
        k.FanOut(0)
    with pytest.raises(TypeError, match="parallel"):
        k.parallel(k.Relu(), "conv")
    with pytest.raises(TypeError, match="ABRelu a"):
        k.ABRelu("0", 1.0)
    with pytest.raises(ValueError, match="eps"):
        k.LayerNorm(eps=-1.0)


@pytest.mark.slow
def test_pooling_kernel_gradient_is_finite_and_correct():
    kernel_fn = _myrtle()
    x = _draw.normal(jax.random.PRNGKey(26), (3, 4, 4, 2))
    grad = jax.jit(jax.grad(lambda x: jnp.sum(kernel_fn(x))))(x)
    assert np.all(np.isfinite(grad))
    with jax.enable_x64(True):
        x64 = jnp.asarray(x[:, :3, :3, :1], jnp.float64)
        check_grads(jax.jit(lambda x: _resnet()(x, x64[:2] + 0.5)), (x64,), order=1, modes=["rev"])


@pytest.mark.slow
def test_pooling_holds_pixel_pairs_until_the_last_pool():
    # Before the last pool: (H*W)^2 per pair; a Myrtle kernel's memory grows 16x from
    # 8x8 to 16x16 images (pixels^2), a conv/flatten kernel's 4x (pixels).
    def temp(kernel_fn, side):
        x = jax.ShapeDtypeStruct((4, side, side, 1), jnp.float32)
        return compiled_memory(kernel_fn, x).temp_bytes

    myrtle = _myrtle()
    assert 10 < temp(myrtle, 16) / temp(myrtle, 8) < 20
    flat = ARCHITECTURES["conv_relu2_flatten"]()
    assert temp(flat, 16) / temp(flat, 8) < 8


@pytest.mark.slow
def test_pooling_in_bfloat16_accumulates_in_float32(more_reference):
    x1, x2 = (jnp.asarray(a, jnp.bfloat16) for a in _inputs(more_reference, "myrtle"))
    got = _jit(_myrtle(), "ntk")(x1, x2)
    with jax.enable_x64(True):
        expected = _jit(_myrtle(), "ntk")(*(jnp.asarray(a, jnp.float64) for a in (x1, x2)))
    assert got.dtype == jnp.bfloat16
    assert_dtype_close("ntk_kernels", got, expected, "bfloat16")


@pytest.mark.parametrize(
    "layers,shape",
    [
        ((k.Conv((3,), padding="VALID"), k.Flatten(), k.Dense()), (2, 2, 1)),
        ((k.Conv((1,)), k.AvgPool((3,)), k.Flatten(), k.Dense()), (2, 2, 1)),
        ((k.Conv((3, 3), padding="VALID"), k.Relu(), k.GlobalAvgPool(), k.Dense()), (2, 2, 5, 1)),
    ],
)
def test_valid_window_larger_than_the_image_is_an_error_not_nan(layers, shape):
    # No output pixel would be left: the mean over none was a silent NaN kernel.
    with pytest.raises(ValueError, match="larger than"):
        k.serial(*layers)(jnp.ones(shape))


# ----------------------------------------------------------------------------------------
# Arc-cosine kernels on the diagonal: the angle of an input with itself is exactly 0, and
# with its negative exactly pi; rounding of cos = cov / sqrt(var1 var2) must not move it.

ARC_COSINE = {
    "relu": (0.0, 1.0, k.Relu),
    "leaky_relu": (0.1, 1.0, lambda: k.LeakyRelu(0.1)),
    "abrelu": (-0.5, 1.5, lambda: k.ABRelu(-0.5, 1.5)),
    "abs": (-1.0, 1.0, k.Abs),
}


def _aligned_stack(name):
    a, b, activation = ARC_COSINE[name]
    spec = [
        ("dense", 1.3, 0.1),
        ("act", a, b),
        ("dense", 1.2, 0.05),
        ("act", a, b),
        ("dense", 1.0, 0.0),
    ]
    layers = [
        k.Dense(W_std=w, b_std=bias) if kind == "dense" else activation() for kind, w, bias in spec
    ]
    return spec, k.serial(*layers)


def _aligned_closed_form(spec, q):
    """(nngp, ntk) at angle 0 for inputs with |x|^2 / d = q: ABRelu(a, b) scales both by
    (a^2 + b^2) / 2 (the arc-cosine kernel at theta = 0), in float64."""
    nngp, ntk = q, 0.0
    for kind, u, v in spec:
        if kind == "dense":
            nngp = u**2 * nngp + v**2
            ntk = nngp + u**2 * ntk
        else:
            nngp, ntk = (u**2 + v**2) / 2 * nngp, (u**2 + v**2) / 2 * ntk
    return nngp, ntk


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", sorted(ARC_COSINE))
def test_arc_cosine_diagonal_matches_the_closed_form(name, dtype):
    spec, kernel_fn = _aligned_stack(name)
    a, b, activation = ARC_COSINE[name]
    antipodal_fn = k.serial(k.Dense(W_std=1.3), activation(), k.Dense())
    x = np.random.default_rng(30).normal(size=(6, 784)).astype(dtype)
    tolerance = {"float32": 1e-6, "float64": 1e-12}[dtype]

    @jax.jit
    def diagonals(x):
        own = kernel_fn(x, get=("nngp", "ntk"))
        cross = kernel_fn(x, x, get=("nngp", "ntk"))
        antipodal = antipodal_fn(x, -x, get=("nngp", "ntk"))
        return [jnp.diagonal(kernel) for kernel in (*own, *cross, *antipodal)]

    with jax.enable_x64(dtype == "float64"):
        got = [np.asarray(d, np.float64) for d in diagonals(jnp.asarray(x))]
    q = np.sum(np.asarray(x, np.float64) ** 2, axis=1) / x.shape[1]
    expected = _aligned_closed_form(spec, q)
    for got_, expected_ in zip(got[:4], expected * 2):  # kernel_fn(x) and kernel_fn(x, x)
        np.testing.assert_allclose(got_, expected_, rtol=tolerance, atol=0)
    # x against -x: theta = pi, where ABRelu(a, b) scales by a b (its derivative's value).
    v = 1.3**2 * q
    for got_, expected_ in zip(got[4:], (-a * b * v, -2 * a * b * v)):
        np.testing.assert_allclose(got_, expected_, rtol=0, atol=tolerance * np.max(v))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_arc_cosine_gradient_on_the_diagonal_is_the_closed_form(dtype):
    # The diagonal entry is affine in q = |x|^2 / d at angle 0, so its gradient is
    # slope * 2 x / d; the cross kernel's gradient in its first argument is half of it
    # (the angle's derivative counts as zero there, as neural-tangents').
    spec, kernel_fn = _aligned_stack("abrelu")
    x = np.random.default_rng(31).normal(size=(3, 7)).astype(dtype)
    slope = _aligned_closed_form(spec, 1.0)[1] - _aligned_closed_form(spec, 0.0)[1]
    expected = slope * 2 * np.asarray(x, np.float64) / x.shape[1]
    tolerance = {"float32": 2e-6, "float64": 1e-12}[dtype]

    @jax.jit
    def grads(x):
        own = jax.grad(lambda x: jnp.trace(kernel_fn(x)))(x)
        cross = jax.grad(lambda x1: jnp.trace(kernel_fn(x1, x)))(x)
        return own, cross

    with jax.enable_x64(dtype == "float64"):
        own, cross = grads(jnp.asarray(x))
        assert own.dtype == jnp.dtype(dtype)
        if dtype == "float64":  # the whole self-kernel is smooth: finite differences agree
            check_grads(jax.jit(lambda x: kernel_fn(x)), (jnp.asarray(x),), order=1, modes=["rev"])
    np.testing.assert_allclose(own, expected, rtol=tolerance, atol=0)
    np.testing.assert_allclose(cross, expected / 2, rtol=tolerance, atol=0)
