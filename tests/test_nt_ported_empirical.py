"""neural-tangents 0.6.5's tests/empirical_test.py, ported to memwise.nt.

Upstream's cases with the import swapped: linearisation and Taylor expansion against
their closed forms, the empirical NTK of every implementation (with and without
``vmap_axes``) against the Jacobian contraction, parallel (pytree) inputs and outputs,
NTK-vector products; each kernel is also held to neural-tangents' own value on the same
inputs and parameters (tests/data/neural_tangents_ported.npz, float64). Sizes as
upstream; ``TAYLOR_RANDOM_SAMPLES`` 3 instead of 10. testAxes is in
test_nt_ported_empirical_axes.py (its grid is large).
"""

from __future__ import annotations

import functools
import operator
import os

import _draw
import _nt_ported_cases as cases
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import random
from jax.tree_util import tree_map

import memwise.nt as nt
from memwise.nt import stax

# neural-tangents' own tests, a conformance suite: `make test` runs it; the fast lane
# keeps memwise's tests of the same layers (test_ntk_*, test_nt_compat).
pytestmark = [pytest.mark.slow, pytest.mark.grid]

DATA = os.path.join(os.path.dirname(__file__), "data", "neural_tangents_ported.npz")
TAYLOR_RANDOM_SAMPLES = 3


def _float64_init(init_fn, shape):
    """The parameters the reference script drew (in float64), as float32 arrays."""
    with jax.enable_x64(True):
        _, params = init_fn(random.PRNGKey(0), shape)
    return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)


@pytest.fixture(scope="module")
def ref():
    with np.load(DATA) as data:
        return dict(data)


def assert_all_close(x, y, rtol=5e-3, atol=5e-3):
    """upstream's assertAllClose: every leaf of two pytrees (float32 tolerance 5e-3)."""
    xs, ys = jax.tree.leaves(x), jax.tree.leaves(y)
    assert len(xs) == len(ys)
    for a, b in zip(xs, ys):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


# ----------------------------------------------------------------------------------------
# Linearisation and Taylor expansion (upstream EmpiricalTest._f and its closed forms)


def _f(x, params, do_alter, do_shift_x=True):
    w1, w2, b = params
    if do_alter:
        b *= 2.0
        w1 += 5.0
        w2 /= 0.9
    if do_shift_x:
        x = x * 2 + 1.0
    return (
        {
            "list": [
                {
                    "quadratic": 0.5 * jnp.dot(jnp.dot(x.T, w1), x) + jnp.dot(w2, x) + b,
                    "linear": jnp.dot(w1, x),
                },
                w2,
            ]
        },
    )


def _f_lin_exact(x0, x, params, do_alter, do_shift_x=True):
    w1, w2, b = params
    f0 = _f(x0, params, do_alter, do_shift_x)
    if do_shift_x:
        x0 = x0 * 2 + 1.0
        x = x * 2 + 1.0
    dx = x - x0
    if do_alter:
        b *= 2.0
        w1 += 5.0
        w2 /= 0.9
    return tree_map(
        operator.add,
        f0,
        (
            {
                "list": [
                    {"quadratic": jnp.dot(jnp.dot(x0.T, w1) + w2, dx), "linear": jnp.dot(w1, dx)},
                    0.0,
                ]
            },
        ),
    )


def _f_2_exact(x0, x, params, do_alter, do_shift_x=True):
    w1, w2, b = params
    f_lin = _f_lin_exact(x0, x, params, do_alter, do_shift_x)
    if do_shift_x:
        x0 = x0 * 2 + 1.0
        x = x * 2 + 1.0
    if do_alter:
        w1 += 5.0
    dx = x - x0
    return tree_map(
        operator.add,
        f_lin,
        ({"list": [{"quadratic": 0.5 * jnp.dot(jnp.dot(dx.T, w1), dx), "linear": 0.0}, 0.0]},),
    )


def _init_data(shape):
    key = random.PRNGKey(0)
    key, s1, s2, s3 = random.split(key, 4)
    w1 = _draw.normal(s1, shape)
    w1 = 0.5 * (w1 + w1.T)
    w2 = _draw.normal(s2, shape)
    b = _draw.normal(s3, (1,) * (len(shape) - 1) + (shape[-1],))
    key, split = random.split(key)
    x0 = _draw.normal(split, (shape[-1], 1))
    return key, (w1, w2, b), x0


@pytest.mark.parametrize("shape", [(3, 3), (4, 4)])
def test_linearization(shape):
    key, params, x0 = _init_data(shape)
    f_lin = nt.linearize(_f, x0)
    for _ in range(TAYLOR_RANDOM_SAMPLES):
        for do_alter in (True, False):
            for do_shift_x in (True, False):
                key, split = random.split(key)
                x = random.normal(split, (shape[-1], 1))
                assert_all_close(
                    _f_lin_exact(x0, x, params, do_alter, do_shift_x=do_shift_x),
                    f_lin(x, params, do_alter, do_shift_x=do_shift_x),
                )


@pytest.mark.parametrize("shape", [(3, 3), (4, 4)])
def test_taylor_expansion(shape):
    key, params, x0 = _init_data(shape)
    f_lin = nt.taylor_expand(_f, x0, 1)
    f_2 = nt.taylor_expand(_f, x0, 2)
    for _ in range(TAYLOR_RANDOM_SAMPLES):
        for do_alter in (True, False):
            for do_shift_x in (True, False):
                key, split = random.split(key)
                x = random.normal(split, (shape[-1], 1))
                assert_all_close(
                    _f_lin_exact(x0, x, params, do_alter, do_shift_x=do_shift_x),
                    f_lin(x, params, do_alter, do_shift_x=do_shift_x),
                )
                assert_all_close(
                    _f_2_exact(x0, x, params, do_alter, do_shift_x=do_shift_x),
                    f_2(x, params, do_alter, do_shift_x=do_shift_x),
                )


# ----------------------------------------------------------------------------------------
# testNTKAgainstDirect: every implementation, vmapped or not, against the contraction


def _compare_kernels(x1, x2, ntk_fns, ntk_fns_vmapped, nngp_fn):
    nngp = nngp_fn(x1, x2)
    ntks = {i: fn(x1, x2) for i, fn in ntk_fns.items()}
    ntk_ref = ntks[nt.NtkImplementation.JACOBIAN_CONTRACTION]
    tree_map(lambda a, b: operator.eq(a.shape, b.shape) or pytest.fail("shapes"), nngp, ntk_ref)
    for ntk in ntks.values():
        assert_all_close(ntk_ref, ntk)
    for fn in ntk_fns_vmapped.values():
        assert_all_close(ntk_ref, fn(x1, x2))
    return ntk_ref, nngp


@pytest.mark.slow
@pytest.mark.parametrize("logits", [1, 2, 3])
@pytest.mark.parametrize("train, test, network", cases.EMPIRICAL_SHAPES, ids=lambda v: str(v))
def test_ntk_against_direct(ref, train, test, network, logits):
    init_fn, f, _ = cases.build_empirical(stax, train[1:], network, logits)
    params = _float64_init(init_fn, (-1,) + train[1:])

    def fns(vmap_axes):
        return {
            i: functools.partial(
                jax.jit(
                    nt.empirical_ntk_fn(f, trace_axes=(), vmap_axes=vmap_axes, implementation=i)
                ),
                params=params,
            )
            for i in nt.NtkImplementation
        }

    nngp_fn = jax.jit(lambda a, b: nt.empirical_nngp_fn(f, trace_axes=())(a, b, params))
    x1, _ = cases.inputs(2, train, True)
    x2, _ = cases.inputs(3, test, True)
    x1, x2 = jnp.asarray(x1, jnp.float32), jnp.asarray(x2, jnp.float32)
    key = f"direct/{train}-{network}-{logits}"
    ntk_same, _ = _compare_kernels(x1, None, fns(None), fns(0), nngp_fn)
    ntk, nngp = _compare_kernels(x1, x2, fns(None), fns(0), nngp_fn)
    # neural-tangents' own values (float64 there; float32 here)
    for got, name in ((ntk_same, "ntk_same"), (ntk, "ntk"), (nngp, "nngp")):
        scale = float(np.max(np.abs(ref[f"{key}/{name}"]))) + 1e-30
        np.testing.assert_allclose(got, ref[f"{key}/{name}"], rtol=1e-4, atol=1e-5 * scale)


# ----------------------------------------------------------------------------------------
# Parallel (pytree) inputs and outputs


@pytest.mark.parametrize("same_inputs", [True, False])
def test_parallel_in_out(same_inputs):
    input_key1, input_key2, net_key = random.split(random.PRNGKey(0), 3)
    x1_1, x1_2 = jnp.split(random.normal(input_key1, (3, 21)), (10,), axis=1)
    x2_1, x2_2 = jnp.split(random.normal(input_key2, (4, 21)), (10,), axis=1)
    x1 = (x1_1, x1_2)
    x2 = (x2_1, x2_2) if not same_inputs else None

    def layer(n_out):
        return stax.parallel(stax.Dense(n_out), stax.Dense(n_out + 1))

    init_fn, apply_fn, _ = stax.serial(layer(1024), layer(1))
    _, params = init_fn(net_key, (x1_1.shape, x1_2.shape))
    ntk_fns = {
        i: functools.partial(
            jax.jit(nt.empirical_ntk_fn(apply_fn, implementation=i)), params=params
        )
        for i in nt.NtkImplementation
    }
    vmapped = {
        i: functools.partial(
            jax.jit(nt.empirical_ntk_fn(apply_fn, implementation=i, vmap_axes=(0, 0))),
            params=params,
        )
        for i in nt.NtkImplementation
    }
    nngp_fn = jax.jit(lambda a, b: nt.empirical_nngp_fn(apply_fn)(a, b, params))
    nngp = nngp_fn(x1, x2)
    assert len(nngp) == 2
    assert nngp[0].shape == nngp[1].shape == (3, 3 if same_inputs else 4)
    _compare_kernels(x1, x2, ntk_fns, vmapped, nngp_fn)


@pytest.mark.parametrize("same_inputs", [True, False])
def test_parallel_nested(same_inputs):
    input_key1, input_key2, net_key = random.split(random.PRNGKey(0), 3)
    x1_1, x1_2, x1_3 = jnp.split(random.normal(input_key1, (3, 33)), (10, 21), axis=1)
    x2_1, x2_2, x2_3 = jnp.split(random.normal(input_key2, (4, 33)), (10, 21), axis=1)
    x1 = ([x1_1, x1_2], x1_3)
    x2 = ([x2_1, x2_2], x2_3) if not same_inputs else None

    def layer(n_out):
        return stax.parallel(
            stax.parallel(stax.Dense(n_out), stax.Dense(n_out + 1)), stax.Dense(n_out + 2)
        )

    init_fn, apply_fn, _ = stax.serial(layer(1024), layer(1))
    _, params = init_fn(net_key, tree_map(jnp.shape, x1))
    ntks = {
        i: jax.jit(nt.empirical_ntk_fn(apply_fn, implementation=i))(x1, x2, params)
        for i in nt.NtkImplementation
    }
    vmapped = {
        i: jax.jit(nt.empirical_ntk_fn(apply_fn, implementation=i, vmap_axes=([0, 0], 0)))(
            x1, x2, params
        )
        for i in nt.NtkImplementation
    }
    ntk_ref = ntks[nt.NtkImplementation.JACOBIAN_CONTRACTION]
    for ntk in list(ntks.values()) + list(vmapped.values()):
        assert_all_close(ntk_ref, ntk)
    nngp = jax.jit(nt.empirical_nngp_fn(apply_fn))(x1, x2, params)
    assert len(nngp) == 2
    shape = (3, 3 if same_inputs else 4)
    assert nngp[0][0].shape == nngp[0][1].shape == nngp[1].shape == shape


# ----------------------------------------------------------------------------------------
# EmpiricalNtkVpTest


@pytest.mark.parametrize("do_jit", [True, False])
@pytest.mark.parametrize("same_inputs", [True, False])
def test_ntk_vp_fn(same_inputs, do_jit):
    n1 = 4
    n2 = n1 if same_inputs else 6
    o = 3
    init_fn, f, _ = stax.serial(stax.Dense(8), stax.Relu(), stax.Dense(o))
    k1, k2, k3, k4 = random.split(random.PRNGKey(1), 4)
    x1 = random.normal(k1, (n1, 7))
    x2 = None if same_inputs else random.normal(k2, (n2, 7))
    _, params = init_fn(k3, x1.shape)
    ntk_ref = nt.empirical_ntk_fn(f, (), vmap_axes=0)(x1, x2, params)
    ntk_ref = jnp.moveaxis(ntk_ref, 1, 2)
    ntk_vp_fn = nt.empirical_ntk_vp_fn(f, x1, x2, params)
    if do_jit:
        ntk_vp_fn = jax.jit(ntk_vp_fn)
    eye = jnp.eye(n2 * o).reshape((n2 * o, n2, o))
    ntk_vps = jax.jit(jax.vmap(ntk_vp_fn))(eye)
    ntk_vps = jnp.moveaxis(ntk_vps, (0,), (2,)).reshape((n1, o, n2, o))
    assert_all_close(ntk_ref, ntk_vps)
    cotangents = random.normal(k4, f(params, x1 if same_inputs else x2).shape)
    ntk_vp_ref = jnp.tensordot(ntk_ref, cotangents, ((2, 3), (0, 1)))
    assert_all_close(ntk_vp_ref, ntk_vp_fn(cotangents))


# ----------------------------------------------------------------------------------------
# StructuredDerivativesTest.test_function: a sample of upstream's functions (vmap_axes None)

FUNCTIONS = {
    "[p[0]**(p[1] + x), p[2] * x + p[0]]": lambda p, x: [
        jnp.abs(p[0]) ** (p[1] + x),
        p[2] * x + p[0],
    ],
    "[p[0] * p[1] * p[2] + (p[0] @ p[1].T) @ (p[2].T @ p[1]) @ x]": lambda p, x: [
        p[0] * p[1] * p[2] + (p[0] @ p[1].T) @ (p[2].T @ p[1]) @ x
    ],
    "(x, (x, p))": lambda p, x: (x, (x, p)),
    "x**2": lambda p, x: x**2,
    "p": lambda p, x: p,
    "p[0] * p[1]": lambda p, x: p[0] * p[1],
    "p[0] + p[1].T": lambda p, x: p[0] + p[1].T,
    "p[2] * x + p[2] / x": lambda p, x: p[2] * x + p[2] / x,
    "np.prod(p[2])": lambda p, x: jnp.prod(p[2]),
    "p[1] / p[0]": lambda p, x: p[1] / p[0],
    "[np.sum(p[0], axis=0), np.sum(p[0], axis=1)]": lambda p, x: [
        jnp.sum(p[0], axis=0),
        jnp.sum(p[0], axis=1),
    ],
}


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_function(name):
    f = FUNCTIONS[name]
    k = random.split(random.PRNGKey(1), 4)
    p = [random.normal(k[0], (3, 3)), random.normal(k[1], (3, 3)), random.normal(k[2], (3, 3))]
    x1 = jnp.cos(random.normal(k[3], (3, 3)))
    x2 = x1 * 1.5
    kernels = [
        nt.empirical_ntk_fn(f, trace_axes=(), implementation=i)(x1, x2, p)
        for i in nt.NtkImplementation
        if i != nt.NtkImplementation.AUTO
    ]
    for other in kernels[1:]:
        assert_all_close(kernels[0], other, rtol=1e-4, atol=1e-4)
    # against jax.jacobian of each output leaf, contracted densely and zipped
    n_leaves = len(jax.tree.leaves(f(p, x1)))
    for i, out in zip(range(n_leaves), jax.tree.leaves(kernels[0])):
        leaf = lambda q, x, i=i: jnp.asarray(jax.tree.leaves(f(q, x))[i])  # noqa: E731
        ndim = leaf(p, x1).ndim
        j1, j2 = (jax.jacobian(leaf)(p, x) for x in (x1, x2))
        dense = sum(
            jnp.tensordot(a, b, (list(range(ndim, a.ndim)), list(range(ndim, b.ndim))))
            for a, b in zip(jax.tree.leaves(j1), jax.tree.leaves(j2))
        )
        order = [a for pair in zip(range(ndim), range(ndim, 2 * ndim)) for a in pair]
        assert_all_close(out, jnp.transpose(dense, order), rtol=1e-4, atol=1e-4)
