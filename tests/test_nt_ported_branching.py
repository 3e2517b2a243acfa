"""neural-tangents 0.6.5's tests/stax/branching_test.py, ported to memwise.nt.

Upstream's ``FanInTest`` compares each kernel to a Monte Carlo estimate from 512
initialisations of width-1,024 networks; here each ``kernel_fn`` is held to
neural-tangents' own analytic kernel on upstream's inputs (float64, 1e-6; stored in
tests/data/neural_tangents_ported.npz by data/make_neural_tangents_ported.py), and one
case keeps upstream's Monte Carlo check at a smaller width (slow). Ported, dense and
convolutional, pooled and flattened: ``FanInConcat`` on the channel axis with an affine
layer after it (upstream's "dense_after_branch_in") and ``FanInSum`` of branches that
end in one ("dense_before_branch_in"). Of upstream's 16 cases that it does not skip,
that is 6 (3 concatenations, 3 sums); the other 10 are ``FanInConcat`` along the batch
or pixel axes (7) and ``FanInProd`` (3), each a ``NotImplementedError`` of memwise.nt
tested below.
"""

from __future__ import annotations

import os

import _nt_ported_cases as cases
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import random

import memwise.nt as nt
from memwise.nt import stax

# neural-tangents' own tests, a conformance suite: `make test` runs it; the fast lane
# keeps memwise's tests of the same layers (test_ntk_*, test_nt_compat).
pytestmark = [pytest.mark.slow, pytest.mark.grid]

DATA = os.path.join(os.path.dirname(__file__), "data", "neural_tangents_ported.npz")


@pytest.fixture(scope="module")
def ref():
    with np.load(DATA) as data:
        return {k: v for k, v in data.items() if k.startswith("fan_in/")}


@pytest.mark.parametrize("case", cases.fan_in_cases(), ids=cases.case_id)
def test_fan_in_concat_matches_neural_tangents(ref, case):
    prefix = "fan_in/" + cases.case_id(case)
    _, _, kernel_fn = cases.build_fan_in(stax, **case)
    with jax.enable_x64(True):
        x1, x2 = (jnp.asarray(ref[f"{prefix}/{x}"]) for x in ("x1", "x2"))
        # compiled: one program (eagerly, each of the kernel's operations compiled alone)
        got = jax.jit(kernel_fn, static_argnums=2)(x1, x2, ("nngp", "ntk"))
        for g, value in zip(("nngp", "ntk"), got):
            np.testing.assert_allclose(value, ref[f"{prefix}/{g}"], rtol=1e-6, atol=1e-12)


def test_unequal_widths_weigh_the_branches():
    # neural-tangents averages a channel concatenation's kernels by channel count.
    x = random.normal(random.PRNGKey(0), (3, 4))
    wide, narrow = stax.Dense(96, W_std=2.0), stax.Dense(32, W_std=0.5)
    _, _, concat = stax.serial(stax.FanOut(2), stax.parallel(wide, narrow), stax.FanInConcat())
    k_wide, k_narrow = wide.kernel_fn(x, None, "nngp"), narrow.kernel_fn(x, None, "nngp")
    np.testing.assert_allclose(
        concat(x, None, "nngp"), (96 * k_wide + 32 * k_narrow) / 128, rtol=1e-6
    )
    # Equal widths: the plain mean, whatever the count.
    _, _, same = stax.serial(
        stax.FanOut(2), stax.parallel(stax.Dense(7), stax.Dense(7, W_std=3.0)), stax.FanInConcat()
    )
    np.testing.assert_allclose(same(x, None, "nngp"), 5 * stax.Dense(7).kernel_fn(x, None, "nngp"))


def test_the_finite_network_concatenates():
    init_fn, apply_fn, _ = stax.serial(
        stax.FanOut(2), stax.parallel(stax.Dense(5), stax.Identity()), stax.FanInConcat()
    )
    shape, params = init_fn(random.PRNGKey(0), (-1, 3))
    out = apply_fn(params, jnp.ones((2, 3)))
    assert shape == (-1, 8) and out.shape == (2, 8)
    np.testing.assert_array_equal(out[:, 5:], 1.0)


@pytest.mark.slow
def test_fan_in_concat_agrees_with_monte_carlo():
    # Upstream's check, at width 256 and 256 samples (its tolerance, 0.02, scaled to
    # the Monte Carlo error of the smaller ensemble).
    case = {"mode": "concat", "model": "fc", "n_branches": 3, "axis": -1, "readout": "none"}
    init_fn, apply_fn, kernel_fn = cases.build_fan_in(stax, **case, width=256)
    x1, x2 = cases.fan_in_inputs("fc")
    mc = nt.monte_carlo_kernel_fn(init_fn, apply_fn, random.PRNGKey(1), 256)
    exact, empirical = kernel_fn(x1, x2, "ntk"), mc(x1, x2, "ntk")
    err = float(jnp.linalg.norm(empirical - exact) / jnp.linalg.norm(exact))
    assert err < 0.1, err


def _two_branches(*after):
    return stax.serial(
        stax.Dense(8), stax.FanOut(2), stax.parallel(stax.Dense(4), stax.Dense(6)), *after
    )


@pytest.mark.parametrize(
    "net, error, words",
    [
        (_two_branches(stax.FanInConcat(), stax.Relu()), ValueError, "affine layer"),
        (_two_branches(stax.FanInConcat(), stax.Erf()), ValueError, "not Gaussian"),
        (
            _two_branches(stax.FanInConcat(), stax.FanOut(2), stax.FanInSum()),
            NotImplementedError,
            "FanInSum",
        ),
        (_two_branches(stax.FanInConcat(0)), NotImplementedError, "along the channel"),
        (_two_branches(stax.FanInConcat(), stax.LayerNorm()), NotImplementedError, "LayerNorm"),
        (_two_branches(stax.FanInConcat(5)), ValueError, "out of range"),
        (
            stax.serial(
                stax.Conv(4, (2, 2)),
                stax.FanOut(2),
                stax.parallel(stax.Identity(), stax.Flatten()),
                stax.FanInConcat(),
            ),
            ValueError,
            "same pixel shape",
        ),
    ],
    ids=["relu", "erf", "sum", "batch axis", "layernorm", "out of range", "pixel shapes"],
)
def test_what_neural_tangents_refuses_is_refused(net, error, words):
    x = jnp.ones((2, 4, 4, 3)) if "Conv" in repr(net.kernel_fn) else jnp.ones((2, 3))
    with pytest.raises(error, match=words):
        net.kernel_fn(x, None, "ntk")


def test_layernorm_after_an_affine_layer_and_a_numpy_axis_are_accepted():
    # A Dense after the concatenation makes it Gaussian again (as upstream); numpy ints
    # are axes, as in neural-tangents.
    x = random.normal(random.PRNGKey(2), (3, 4))
    after = (stax.Dense(16), stax.LayerNorm(), stax.Relu())
    _, _, concat = _two_branches(stax.FanInConcat(np.int64(-1)), *after)
    _, _, same = _two_branches(stax.FanInConcat(-1), *after)
    np.testing.assert_array_equal(concat(x, None, "ntk"), same(x, None, "ntk"))


def test_fan_in_prod_is_not_implemented():
    with pytest.raises(NotImplementedError, match="FanInProd"):
        stax.FanInProd  # noqa: B018
