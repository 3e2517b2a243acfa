"""memwise.nt.stax: neural-tangents' layers, kernels against its stored values, finite
networks against the kernels by Monte Carlo."""

from __future__ import annotations

import math
import os

import _draw
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from memwise.nt import stax
from memwise.ntk import kernels as k

DATA = os.path.join(os.path.dirname(__file__), "data")


@pytest.fixture(scope="module")
def reference():
    # neural-tangents 0.6.5 on jax 0.4.30, float64 (data/neural_tangents_*.README.md).
    values = {}
    for name in ("neural_tangents_kernels.npz", "neural_tangents_more.npz"):
        with np.load(os.path.join(DATA, name)) as data:
            values[name] = dict(data)
    return values


def _fc(activation):
    return stax.serial(stax.Dense(512, W_std=1.3, b_std=0.1), activation, stax.Dense(10))


# The architectures as neural-tangents' programs wrote them (only the import changed).
ARCHITECTURES = {
    ("neural_tangents_kernels.npz", "conv", "conv_relu2_flatten"): lambda: stax.serial(
        stax.Conv(64, (3, 3), padding="SAME"),
        stax.Relu(),
        stax.Conv(64, (3, 3), padding="SAME"),
        stax.Relu(),
        stax.Flatten(),
        stax.Dense(10),
    ),
    ("neural_tangents_kernels.npz", "conv", "conv_relu_gap"): lambda: stax.serial(
        stax.Conv(64, (3, 3), padding="SAME"), stax.Relu(), stax.GlobalAvgPool(), stax.Dense(10)
    ),
    ("neural_tangents_kernels.npz", "fc", "fc_relu_erf"): lambda: stax.serial(
        stax.Dense(1024, W_std=1.5, b_std=0.05),
        stax.Relu(),
        stax.Dense(1024, W_std=1.5, b_std=0.05),
        stax.Erf(),
        stax.Dense(10),
    ),
    ("neural_tangents_more.npz", "img", "myrtle"): lambda: stax.serial(
        stax.Conv(32, (3, 3), padding="SAME"),
        stax.Relu(),
        stax.Conv(32, (3, 3), padding="SAME"),
        stax.Relu(),
        stax.AvgPool((2, 2), strides=(2, 2)),
        stax.Conv(32, (3, 3), padding="SAME"),
        stax.Relu(),
        stax.AvgPool((2, 2), strides=(2, 2)),
        stax.Flatten(),
        stax.Dense(10),
    ),
    ("neural_tangents_more.npz", "img", "resnet"): lambda: stax.serial(
        stax.Conv(32, (3, 3), padding="SAME", W_std=1.4, b_std=0.1),
        stax.FanOut(2),
        stax.parallel(
            stax.Identity(),
            stax.serial(stax.Relu(), stax.Conv(32, (3, 3), padding="SAME", W_std=1.4)),
        ),
        stax.FanInSum(),
        stax.Relu(),
        stax.GlobalAvgPool(),
        stax.Dense(10),
    ),
    # No padding argument: neural-tangents' default, VALID.
    ("neural_tangents_more.npz", "img", "conv_valid_stride"): lambda: stax.serial(
        stax.Conv(32, (3, 3), strides=(2, 2)), stax.Relu(), stax.Flatten(), stax.Dense(10)
    ),
    ("neural_tangents_more.npz", "fc", "fc_gelu"): lambda: _fc(stax.Gelu()),
    ("neural_tangents_more.npz", "fc", "fc_sigmoid_like"): lambda: _fc(stax.Sigmoid_like()),
    ("neural_tangents_more.npz", "fc", "fc_leaky_relu"): lambda: _fc(stax.LeakyRelu(0.1)),
    ("neural_tangents_more.npz", "fc", "fc_abrelu"): lambda: _fc(stax.ABRelu(-0.5, 1.5)),
    ("neural_tangents_more.npz", "fc", "fc_sin"): lambda: _fc(stax.Sin(a=1, b=2, c=0.3)),
    ("neural_tangents_more.npz", "fc", "fc_abs"): lambda: _fc(stax.Abs()),
    ("neural_tangents_more.npz", "fc", "fc_layernorm"): lambda: stax.serial(
        stax.Dense(512, W_std=1.3, b_std=0.1), stax.LayerNorm(), stax.Relu(), stax.Dense(10)
    ),
    ("neural_tangents_more.npz", "fc", "fc_deep_erf"): lambda: stax.serial(
        *[
            layer
            for _ in range(4)
            for layer in (stax.Dense(512, W_std=1.5, b_std=0.05), stax.Erf())
        ],
        stax.Dense(10),
    ),
}


@pytest.mark.parametrize("key", sorted(ARCHITECTURES), ids=lambda key: key[2])
@pytest.mark.slow
def test_kernels_match_neural_tangents_in_float64(reference, key):
    file, inputs, name = key
    data = reference[file]
    _, _, kernel_fn = ARCHITECTURES[key]()
    with jax.enable_x64(True):
        x1, x2 = (jnp.asarray(data[f"{inputs}_x{i}"]) for i in (1, 2))
        both = jax.jit(lambda a, b: kernel_fn(a, b, ("nngp", "ntk")))(x1, x2)
        assert both._fields == ("nngp", "ntk")
        np.testing.assert_allclose(both.nngp, data[f"{name}_nngp"], rtol=1e-10, atol=0)
        np.testing.assert_allclose(both.ntk, data[f"{name}_ntk"], rtol=1e-10, atol=0)


def test_conv_pads_valid_by_default_as_neural_tangents():
    # memwise.ntk.kernels.Conv pads SAME; the compatibility layer keeps stax's VALID.
    x = _draw.normal(jax.random.PRNGKey(0), (2, 6, 6, 1))
    _, _, kernel_fn = stax.serial(stax.Conv(8, (3, 3)), stax.Relu(), stax.Flatten(), stax.Dense(1))
    valid = k.serial(k.Conv((3, 3), padding="VALID"), k.Relu(), k.Flatten(), k.Dense())
    same = k.serial(k.Conv((3, 3)), k.Relu(), k.Flatten(), k.Dense())
    got = kernel_fn(x, None, "ntk")
    np.testing.assert_allclose(got, valid(x), rtol=1e-6)
    assert not np.allclose(got, same(x), rtol=1e-3)


def _nngp_estimate(init_fn, apply_fn, x1, x2, n_inits):
    """Mean over inits of h(x1) h(x2)^T / width for the network's output features h.

    The NNGP of a network is the covariance of its features over the units of a layer
    (each unit one sample; their mean, not a readout layer, so that features with a
    nonzero mean add no readout noise).
    """

    def one(key):
        _, params = init_fn(key, x1.shape)
        f1, f2 = (apply_fn(params, x).reshape(x.shape[0], -1) for x in (x1, x2))
        return f1 @ f2.T / f1.shape[-1]

    return jnp.mean(jax.vmap(one)(jax.random.split(jax.random.PRNGKey(1), n_inits)), axis=0)


MONTE_CARLO = {
    "fc": (
        lambda w: stax.serial(
            stax.Dense(w, W_std=1.3, b_std=0.1),
            stax.Relu(),
            stax.Dense(w, W_std=1.5, b_std=0.05),
            stax.Erf(),
            stax.Dense(w, W_std=1.2),
            stax.Gelu(),
        ),
        (5, 6),
    ),
    "residual_layernorm": (
        lambda w: stax.serial(
            stax.Dense(w, W_std=1.3, b_std=0.1),
            stax.FanOut(2),
            stax.parallel(
                stax.serial(stax.Sin(a=1.0, b=2.0, c=0.3), stax.Dense(w)),
                stax.serial(stax.Abs(), stax.Dense(w, b_std=0.2)),
            ),
            stax.FanInSum(),
            # LayerNorm's kernel assumes zero-mean Gaussian inputs: after a linear layer.
            stax.LayerNorm(),
            stax.LeakyRelu(0.2),
        ),
        (5, 6),
    ),
    "conv_pool": (
        lambda w: stax.serial(
            stax.Conv(w, (3, 3), padding="SAME", b_std=0.1),
            stax.Relu(),
            stax.AvgPool((2, 2), strides=(2, 2)),
            stax.Conv(w, (3, 3), W_std=1.3),
            stax.Sigmoid_like(),
            stax.GlobalAvgPool(),
        ),
        (4, 8, 8, 2),
    ),
    "conv_flatten": (
        lambda w: stax.serial(
            stax.Conv(w, (3, 3), strides=(2, 2), b_std=0.2),
            stax.ABRelu(-0.3, 1.2),
            stax.Flatten(),
        ),
        (4, 7, 7, 2),
    ),
}


@pytest.mark.parametrize("name", sorted(MONTE_CARLO))
@pytest.mark.slow
def test_finite_networks_converge_to_the_kernel(name):
    # Both halves of every layer: the finite network (init_fn, apply_fn) at width 1024
    # (256 channels), its features' covariance over units and inits, against kernel_fn.
    make, shape = MONTE_CARLO[name]
    rng = np.random.default_rng(2)
    x1 = jnp.asarray(rng.normal(size=shape), jnp.float32)
    x2 = jnp.asarray(rng.normal(size=(3,) + shape[1:]), jnp.float32)
    init_fn, apply_fn, kernel_fn = make(1024 if not name.startswith("conv") else 256)
    estimate = jax.jit(lambda a, b: _nngp_estimate(init_fn, apply_fn, a, b, 8))(x1, x2)
    exact = kernel_fn(x1, x2, "nngp")
    scale = float(jnp.max(jnp.abs(exact)))
    np.testing.assert_allclose(estimate, exact, rtol=0, atol=0.05 * scale)


@pytest.mark.slow
def test_empirical_ntk_of_a_wide_network_is_the_kernel():
    init_fn, apply_fn, kernel_fn = stax.serial(
        stax.Dense(2048, W_std=1.5, b_std=0.1),
        stax.Relu(),
        stax.Dense(2048),
        stax.Erf(),
        stax.Dense(1),
    )
    x = jnp.asarray(np.random.default_rng(3).normal(size=(4, 5)), jnp.float32)

    def ntk(key):
        _, params = init_fn(key, x.shape)
        jac = jax.jacobian(lambda p: apply_fn(p, x)[:, 0])(params)
        rows = jnp.concatenate([j.reshape(x.shape[0], -1) for j in jax.tree.leaves(jac)], 1)
        return rows @ rows.T

    estimate = jnp.mean(jax.jit(jax.vmap(ntk))(jax.random.split(jax.random.PRNGKey(4), 4)), 0)
    exact = kernel_fn(x, None, "ntk")
    np.testing.assert_allclose(estimate, exact, rtol=0, atol=0.05 * float(jnp.max(exact)))


def test_parameter_layout_is_neural_tangents():
    init_fn, apply_fn, _ = stax.serial(
        stax.Conv(4, (3, 2), strides=(1, 2), b_std=0.1),
        stax.Relu(),
        stax.Flatten(),
        stax.Dense(3),
        stax.FanOut(2),
        stax.parallel(stax.Dense(5, b_std=0.3), stax.Identity()),
    )
    shape, params = init_fn(jax.random.PRNGKey(0), (-1, 6, 7, 2))
    assert shape == [(-1, 5), (-1, 3)]
    assert isinstance(params, list) and len(params) == 6
    (w, b), relu, flatten, (w2, b2), fan, (branch, identity) = params
    assert w.shape == (3, 2, 2, 4) and b.shape == (1, 1, 1, 4)
    assert relu == flatten == fan == identity == ()
    assert w2.shape == (4 * 3 * 4, 3) and b2 is None
    assert branch[0].shape == (3, 5) and branch[1].shape == (1, 5)
    x = jnp.ones((2, 6, 7, 2))
    out = apply_fn(params, x)
    assert [o.shape for o in out] == [(2, 5), (2, 3)]
    # NTK parameterization: standard-normal weights, scaled by W_std / sqrt(fan_in).
    conv = jax.lax.conv_general_dilated(
        x, w, (1, 2), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    expected = conv / math.sqrt(2 * 6) + 0.1 * b
    features = jnp.maximum(expected, 0).reshape(2, -1)
    np.testing.assert_allclose(out[1], features @ w2 / math.sqrt(features.shape[1]), rtol=1e-5)


BAD_INPUTS = {
    "FanInProd": (lambda: stax.FanInProd(), NotImplementedError, "stax.FanInProd"),
    "SumPool": (lambda: stax.SumPool((2, 2)), NotImplementedError, "stax.SumPool"),
    "s": (lambda: stax.Dense(8, parameterization="standard", s=(0, 1)), ValueError, "Dense s"),
    "parameterization": (
        lambda: stax.Conv(8, (3, 3), parameterization="muP"),
        ValueError,
        "parameterization",
    ),
    "CIRCULAR": (lambda: stax.Conv(8, (3, 3), padding="CIRCULAR"), NotImplementedError, "CIRCULAR"),
    "dimension_numbers": (
        lambda: stax.Conv(8, (3, 3), dimension_numbers=("NCHW", "OIHW", "NCHW")),
        NotImplementedError,
        "dimension_numbers",
    ),
    "normalize_edges": (
        lambda: stax.AvgPool((2, 2), normalize_edges=True),
        NotImplementedError,
        "normalize_edges",
    ),
    "channel_axis": (lambda: stax.Dense(8, channel_axis=1), NotImplementedError, "channel_axis"),
    "Gelu approximate": (lambda: stax.Gelu(approximate=True), NotImplementedError, "approximate"),
    "LayerNorm axis": (lambda: stax.LayerNorm(axis=(1, 2, 3)), NotImplementedError, "axis"),
    "out_dim": (lambda: stax.Dense(0), ValueError, "out_dim"),
    "W_std": (lambda: stax.Dense(8, W_std="x"), TypeError, "Dense W_std"),
    "LeakyRelu alpha": (lambda: stax.LeakyRelu("a"), TypeError, "LeakyRelu alpha"),
    "serial layer": (lambda: stax.serial(stax.Relu(), k.Relu()), TypeError, "serial()"),
    "get None": (
        lambda: stax.Dense(1).kernel_fn(jnp.ones((2, 3))),
        NotImplementedError,
        "get=None",
    ),
    "get cov1": (
        lambda: stax.Dense(1).kernel_fn(jnp.ones((2, 3)), get="cov1"),
        NotImplementedError,
        "cov1",
    ),
    "get unknown": (
        lambda: stax.Dense(1).kernel_fn(jnp.ones((2, 3)), get="nntk"),
        ValueError,
        "get",
    ),
    "shapes": (
        lambda: stax.Dense(1).kernel_fn(jnp.ones((2, 3)), jnp.ones((2, 4)), "nngp"),
        ValueError,
        "same shape per input",
    ),
}


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_input_and_unsupported_layers_are_named(name):
    call, error, words = BAD_INPUTS[name]
    with pytest.raises(error) as info:
        call()
    assert words in str(info.value), str(info.value)
