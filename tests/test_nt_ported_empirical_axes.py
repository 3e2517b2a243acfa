"""neural-tangents 0.6.5's EmpiricalTest.testAxes (tests/empirical_test.py), ported.

Every (diagonal_axes, trace_axes) pair of upstream's grid that does not share an axis,
on upstream's CONV network with 3 channels out and inputs (4, 5, 6, 3) / (2, 5, 6, 3):
all implementations with and without ``vmap_axes=0`` against the Jacobian contraction
(as upstream), and that against neural-tangents' own kernel on the same parameters and
inputs (tests/data/neural_tangents_ported.npz). Its own file: the grid compiles a few
hundred programs.
"""

from __future__ import annotations

import functools
import os

import _nt_ported_cases as cases
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import random

import memwise.nt as nt
from memwise.nt import stax

pytestmark = [pytest.mark.slow, pytest.mark.grid]  # about 10 s a case on CPU

DATA = os.path.join(os.path.dirname(__file__), "data", "neural_tangents_ported.npz")


def _float64_init(init_fn, shape):
    """The parameters the reference script drew (in float64), as float32 arrays."""
    with jax.enable_x64(True):
        _, params = init_fn(random.PRNGKey(0), shape)
    return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)


@pytest.fixture(scope="module")
def setup():
    with np.load(DATA) as data:
        ref = dict(data)
    init_fn, f, _ = cases.build_empirical(stax, (5, 6, 3), "CONV", 3)
    params = _float64_init(init_fn, (-1, 5, 6, 3))
    x1 = jnp.asarray(cases.inputs(4, (4, 5, 6, 3), True)[0], jnp.float32)
    x2 = jnp.asarray(cases.inputs(5, (2, 5, 6, 3), True)[0], jnp.float32)
    return ref, f, params, x1, x2


def _close(a, b):
    scale = float(np.max(np.abs(b))) + 1e-30
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize(
    "diagonal_axes, trace_axes",
    cases.axes_cases(),
    ids=[cases.axes_key(*c) for c in cases.axes_cases()],
)
def test_axes(setup, diagonal_axes, trace_axes):
    ref, f, params, x1, x2 = setup
    key = "axes/" + cases.axes_key(diagonal_axes, trace_axes)
    kw = dict(trace_axes=trace_axes, diagonal_axes=diagonal_axes)
    ntk_fns = {
        (i, v): functools.partial(
            jax.jit(nt.empirical_ntk_fn(f, **kw, vmap_axes=v, implementation=i)), params=params
        )
        for i in (
            nt.NtkImplementation.JACOBIAN_CONTRACTION,
            nt.NtkImplementation.NTK_VECTOR_PRODUCTS,
        )
        for v in (None, 0)
    }
    nngp = nt.empirical_nngp_fn(f, **kw)(x1, None, params)
    pairs = [(None, "ntk_same")]
    if 0 not in {a % 4 for a in trace_axes + diagonal_axes}:
        pairs.append((x2, "ntk"))
    for b, name in pairs:
        kernels = [fn(x1, b) for fn in ntk_fns.values()]
        for k in kernels[1:]:
            _close(k, kernels[0])
        assert nngp.shape == kernels[0].shape or b is not None
        _close(kernels[0], ref[f"{key}/{name}"])
    _close(nngp, ref[f"{key}/nngp_same"])
