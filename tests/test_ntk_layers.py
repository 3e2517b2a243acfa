"""The layers of memwise.ntk.kernels: argument checks, the public import paths, and the conv
window over a full covariance against the same mean written out pixel by pixel."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from jax import lax

from memwise.ntk import _covariance
from memwise.ntk import kernels as k
from memwise.ntk.linear import _window_mean

# Every layer constructor's arguments: a TypeError/ValueError naming the layer and the
# argument, before any tracing.
LAYER_BAD_INPUTS = {
    "Dense W_std str": (lambda: k.Dense(W_std="x"), TypeError, "Dense W_std"),
    "Dense W_std negative": (lambda: k.Dense(W_std=-1.0), ValueError, "Dense W_std"),
    "Dense W_std inf": (lambda: k.Dense(W_std=float("inf")), ValueError, "Dense W_std"),
    "Dense b_std str": (lambda: k.Dense(b_std="0.1"), TypeError, "Dense b_std"),
    "Dense b_std nan": (lambda: k.Dense(b_std=float("nan")), ValueError, "Dense b_std"),
    "Conv filter_shape int": (lambda: k.Conv(3), TypeError, "Conv filter_shape"),
    "Conv filter_shape float": (lambda: k.Conv((2.5, 3)), TypeError, "Conv filter_shape"),
    "Conv filter_shape zero": (lambda: k.Conv((0, 3)), ValueError, "Conv filter_shape"),
    "Conv filter_shape empty": (lambda: k.Conv(()), ValueError, "Conv filter_shape"),
    "Conv strides int": (lambda: k.Conv((3, 3), strides=2), TypeError, "Conv strides"),
    "Conv strides length": (lambda: k.Conv((3, 3), strides=(1,)), ValueError, "Conv strides"),
    "Conv strides zero": (lambda: k.Conv((3, 3), strides=(1, 0)), ValueError, "Conv strides"),
    "Conv padding": (lambda: k.Conv((3, 3), padding="FULL"), ValueError, "Conv padding"),
    "Conv padding type": (lambda: k.Conv((3, 3), padding=1), ValueError, "Conv padding"),
    "Conv W_std": (lambda: k.Conv((3, 3), W_std="x"), TypeError, "Conv W_std"),
    "Conv b_std": (lambda: k.Conv((3, 3), b_std=-0.1), ValueError, "Conv b_std"),
    "AvgPool window_shape": (lambda: k.AvgPool("2"), TypeError, "AvgPool window_shape"),
    "AvgPool window_shape zero": (lambda: k.AvgPool((2, 0)), ValueError, "AvgPool window_shape"),
    "AvgPool strides": (lambda: k.AvgPool((2, 2), strides=(0, 0)), ValueError, "AvgPool strides"),
    "AvgPool strides type": (lambda: k.AvgPool((2, 2), strides=2), TypeError, "AvgPool strides"),
    "AvgPool padding": (lambda: k.AvgPool((2, 2), padding="FULL"), ValueError, "AvgPool padding"),
    "ABRelu a": (lambda: k.ABRelu("0", 1.0), TypeError, "ABRelu a"),
    "ABRelu b": (lambda: k.ABRelu(0.0, None), TypeError, "ABRelu b"),
    "ABRelu b inf": (lambda: k.ABRelu(0.0, float("inf")), ValueError, "ABRelu b"),
    "LeakyRelu alpha": (lambda: k.LeakyRelu("a"), TypeError, "LeakyRelu alpha"),
    "LeakyRelu alpha nan": (lambda: k.LeakyRelu(float("nan")), ValueError, "LeakyRelu alpha"),
    "Erf a": (lambda: k.Erf(a="1"), TypeError, "Erf a"),
    "Erf b": (lambda: k.Erf(b=True), TypeError, "Erf b"),
    "Erf c": (lambda: k.Erf(c=float("inf")), ValueError, "Erf c"),
    "Sin a": (lambda: k.Sin(a=[1.0]), TypeError, "Sin a"),
    "Sin b": (lambda: k.Sin(b="2"), TypeError, "Sin b"),
    "Sin c": (lambda: k.Sin(c=float("nan")), ValueError, "Sin c"),
    "LayerNorm eps": (lambda: k.LayerNorm(eps="1e-6"), TypeError, "LayerNorm eps"),
    "LayerNorm eps negative": (lambda: k.LayerNorm(eps=-1.0), ValueError, "LayerNorm eps"),
    "FanOut n zero": (lambda: k.FanOut(0), ValueError, "FanOut n"),
    "FanOut n float": (lambda: k.FanOut(2.0), TypeError, "FanOut n"),
    "FanOut n bool": (lambda: k.FanOut(True), TypeError, "FanOut n"),
    "parallel empty": (lambda: k.parallel(), ValueError, "parallel()"),
    "parallel layer": (lambda: k.parallel(k.Relu(), "conv"), TypeError, "parallel()"),
    "serial layer": (lambda: k.serial(k.Dense(), k.Relu), TypeError, "serial()"),
}


@pytest.mark.parametrize("name", sorted(LAYER_BAD_INPUTS))
def test_layer_bad_input_names_the_layer_and_argument(name):
    call, error, words = LAYER_BAD_INPUTS[name]
    with pytest.raises(error) as info:
        call()
    assert words in str(info.value), str(info.value)
    assert "jax._src" not in str(info.value)


def test_layer_hyperparameters_accept_numpy_numbers():
    # NumPy scalars are numbers: stored as Python floats/ints, the same layer as 1.5 / 2.
    assert k.Dense(W_std=np.float32(1.5), b_std=np.float64(0.5)) == k.Dense(1.5, 0.5)
    assert k.Conv((np.int64(3), 3), strides=np.array([1, 1])) == k.Conv((3, 3))
    assert k.FanOut(np.int32(2)) == k.FanOut(2)
    assert k.LeakyRelu(np.float64(0.1)) == k.ABRelu(0.1, 1.0)


# The public names of memwise.ntk.kernels: each layer lives in the module of its concept
# and is re-exported here; this list is the import contract.
PUBLIC_KERNEL_NAMES = [
    "ABRelu",
    "Abs",
    "AvgPool",
    "Conv",
    "Dense",
    "Erf",
    "FanInSum",
    "FanOut",
    "Flatten",
    "Gelu",
    "GlobalAvgPool",
    "Identity",
    "KernelFn",
    "Layer",
    "LayerNorm",
    "LeakyRelu",
    "Prepared",
    "Relu",
    "Sigmoid_like",
    "Sin",
    "parallel",
    "serial",
]


def test_public_import_paths_keep_working():
    module = importlib.import_module("memwise.ntk.kernels")
    assert sorted(module.__all__) == PUBLIC_KERNEL_NAMES
    namespace: dict = {}
    exec("from memwise.ntk.kernels import *", namespace)
    for name in PUBLIC_KERNEL_NAMES:
        assert namespace[name] is getattr(module, name)
    # The registry is the list of layers: every registered constructor is exported, and
    # every exported layer constructor is registered (error messages list the registry).
    assert set(_covariance._LAYERS) == set(PUBLIC_KERNEL_NAMES) - {"KernelFn", "Layer", "Prepared"}
    for name, constructor in _covariance._LAYERS.items():
        assert getattr(module, name) is constructor
        arguments = {"FanOut": (2,), "Conv": ((3,),), "AvgPool": ((2,),), "LeakyRelu": (0.1,)}
        arguments.update({"ABRelu": (0.0, 1.0), "parallel": (k.Relu(),), "serial": (k.Relu(),)})
        layer = constructor(*arguments.get(name, ()))
        assert isinstance(layer, k.Layer), name
    with pytest.raises(TypeError) as info:
        k.serial(k.Dense(), "dense")
    assert all(name in str(info.value) for name in _covariance._LAYERS)


@pytest.mark.parametrize(
    ("batch", "pixels", "window", "strides", "padding"),
    [
        ((2, 3), (7, 6), (3, 3), (1, 1), "SAME"),
        ((2, 3), (7, 6), (3, 2), (2, 1), "VALID"),
        ((1,), (6, 5), (3, 3), (2, 2), "SAME"),
        ((2, 1), (9,), (4,), (3,), "SAME"),
        ((1, 2), (4, 3, 5), (2, 3, 1), (1, 2, 1), "VALID"),
    ],
)
def test_conv_window_along_the_diagonal_of_a_full_covariance(
    batch, pixels, window, strides, padding
):
    # Each output (p, q) is the mean of cov[p*s + d - lo, q*s + d - lo] over the window's
    # offsets d, zeros outside the image: written out pixel by pixel.
    rng = np.random.default_rng(0)
    cov = rng.normal(size=batch + pixels + pixels).astype(np.float32)
    layout = _covariance._Layout(len(batch), len(pixels), True)
    got = np.asarray(_window_mean(cov, layout, window, strides, padding))
    pads = lax.padtype_to_pads(pixels, window, strides, padding)
    out = [(n + lo + hi - w) // s + 1 for n, (lo, hi), w, s in zip(pixels, pads, window, strides)]
    want = np.zeros(batch + tuple(out) * 2, np.float64)
    for p in np.ndindex(*out):
        for q in np.ndindex(*out):
            for d in np.ndindex(*window):
                i = [pi * s + di - lo for pi, s, di, (lo, _) in zip(p, strides, d, pads)]
                j = [qi * s + di - lo for qi, s, di, (lo, _) in zip(q, strides, d, pads)]
                if all(0 <= a < n for a, n in zip(i + j, pixels + pixels)):
                    want[(...,) + p + q] += cov[(...,) + tuple(i) + tuple(j)]
    np.testing.assert_allclose(got, want / np.prod(window), rtol=1e-5, atol=1e-6)
