"""neural-tangents 0.6.5's tests/stax/stax_test.py, ported to memwise.nt.

Upstream compares each kernel to a Monte Carlo estimate from 100 initialisations of
width-1,024 networks (``_check_agreement_with_empirical``); here each ``kernel_fn`` is
held to neural-tangents' own analytic kernel on the same inputs, stored in
tests/data/neural_tangents_ported.npz by data/make_neural_tangents_ported.py (float64,
to 1e-6), and a few cases keep upstream's Monte Carlo check (slow). Changes from
upstream: NHWC / NC layouts only (upstream draws random dimension orders), no
CIRCULAR padding, attention or SumPool (memwise.nt raises NotImplementedError for them;
tested in test_ntk_compat_stax.py), and ``get`` a tuple where upstream reads
neural-tangents' ``Kernel`` object.
"""

from __future__ import annotations

import os

import _nt_ported_cases as cases
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import memwise.nt as nt
from memwise.nt import stax

# neural-tangents' own tests, a conformance suite: `make test` runs it; the fast lane
# keeps memwise's tests of the same layers (test_ntk_*, test_nt_compat).
# A tenth of each grid's cases (tests/_grid.py; stratified, so every value of every
# parameter still runs in each sample; MEMWISE_TEST_GRID=full runs them all).
pytestmark = [pytest.mark.slow, pytest.mark.grid(fraction=0.1)]

DATA = os.path.join(os.path.dirname(__file__), "data", "neural_tangents_ported.npz")


@pytest.fixture(scope="module")
def ref():
    with np.load(DATA) as data:
        return dict(data)


def _compare(ref, prefix, kernel_fn, x1, x2):
    with jax.enable_x64(True):
        # compiled: one program (eagerly, 100-180 of the kernel's operations each compiled
        # on its own)
        got = jax.jit(kernel_fn, static_argnums=2)(
            jnp.asarray(x1), None if x2 is None else jnp.asarray(x2), ("nngp", "ntk")
        )
        for g in ("nngp", "ntk"):
            np.testing.assert_allclose(got[g == "ntk"], ref[f"{prefix}/{g}"], rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("case", cases.exact_cases(), ids=cases.case_id)
def test_exact(ref, case):
    (_, _, kernel_fn), shape = cases.build_net(stax, **case)
    x1, x2 = cases.inputs(1, shape)
    _compare(ref, "exact/" + cases.case_id(case), kernel_fn, x1, x2)


SUPPORTED_NORMS = {("fc", "C"), ("conv", "C")}


@pytest.mark.parametrize(
    "case",
    [
        c
        if (c["model"], c["layer_norm"]) in SUPPORTED_NORMS
        else pytest.param(
            c,
            marks=pytest.mark.xfail(
                raises=NotImplementedError, strict=True, reason="LayerNorm over non-channel axes"
            ),
        )
        for c in cases.layernorm_cases()
    ],
    ids=cases.case_id,
)
def test_layernorm(ref, case):
    kw = dict(case, layer_norm=cases.layernorm_axis(case["model"], case["layer_norm"]))
    (_, _, kernel_fn), shape = cases.build_net(stax, **kw)
    x1, x2 = cases.inputs(1, shape)
    _compare(ref, "layernorm/" + cases.case_id(case), kernel_fn, x1, x2)


@pytest.mark.parametrize("case", cases.pool_cases(), ids=cases.case_id)
def test_pool(ref, case):
    _, _, kernel_fn = cases.build_pool(stax, **case)
    x1, x2 = cases.inputs(1, cases.INPUT_SHAPE)
    _compare(ref, "pool/" + cases.case_id(case), kernel_fn, x1, x2)


# 576 cases: 3% (18, the stratified minimum is 8) in `make test`, all in `make test-full`.
@pytest.mark.grid(fraction=0.03)
@pytest.mark.parametrize("same", [True, False])
@pytest.mark.parametrize("case", cases.linear_cases(), ids=cases.case_id)
def test_linear(ref, case, same):
    _, _, kernel_fn = cases.build_linear(stax, **case)
    x1, x2 = cases.inputs(1, (cases.BATCH_SIZE, 3), same)
    _compare(ref, f"linear/{cases.case_id(case)}-same={same}", kernel_fn, x1, x2)


# 180 cases: 5% (9) in `make test`.
@pytest.mark.grid(fraction=0.05)
@pytest.mark.parametrize("case", cases.nonlinear_cases(), ids=cases.case_id)
def test_nonlinear(ref, case):
    (_, _, kernel_fn), shape = cases.build_net(stax, **case)
    x1, x2 = cases.inputs(1, shape)
    _compare(ref, "nonlinear/" + cases.case_id(case), kernel_fn, x1, x2)


def test_composition_dense():
    # Upstream feeds a Kernel object back into kernel_fn; memwise.nt composes layers with
    # serial only: the same two-block network, its kernel against the one-block kernel
    # evaluated twice is not expressible, so the check is serial's associativity.
    x1 = jax.random.normal(jax.random.PRNGKey(0), (2, 3))
    x2 = jax.random.normal(jax.random.PRNGKey(1), (4, 3))
    block = stax.serial(stax.Dense(256), stax.Relu())
    nested = stax.serial(block, block).kernel_fn
    flat = stax.serial(stax.Dense(256), stax.Relu(), stax.Dense(256), stax.Relu()).kernel_fn
    for a, b in ((x1, None), (x1, x2)):
        np.testing.assert_allclose(nested(a, b, "nngp"), flat(a, b, "nngp"), rtol=1e-6)


# Upstream's Monte Carlo agreement (_check_agreement_with_empirical), on a few cases: the
# finite network's init_fn/apply_fn against kernel_fn. Upstream: 100 samples, rtol 0.041.
MONTE_CARLO = [
    dict(model="fc", is_ntk=False, is_res=True),
    dict(model="fc", is_ntk=True, is_res=False),
    dict(model="conv", padding="SAME", use_pooling=True, is_ntk=False, proj="POOL"),
    # the standard parameterization: weights scaled at initialisation, widths times s
    dict(model="fc", is_ntk=True, is_res=True, parameterization="standard", s=4),
    dict(model="conv", padding="SAME", is_ntk=True, proj="POOL", parameterization="standard", s=2),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", MONTE_CARLO, ids=cases.case_id)
def test_exact_against_monte_carlo(case):
    width = 512 if case["model"] == "fc" else 128
    (init_fn, apply_fn, kernel_fn), shape = cases.build_net(stax, width=width, **case)
    x1, x2 = (jnp.asarray(x, jnp.float32) for x in cases.inputs(1, shape))
    get = "ntk" if case["is_ntk"] else "nngp"
    mc = nt.monte_carlo_kernel_fn(
        init_fn, apply_fn, jax.random.PRNGKey(1), 16, trace_axes=(-1,), vmap_axes=0
    )
    exact = jax.jit(kernel_fn, static_argnums=2)(x1, x2, get)  # one program, as _compare
    empirical = mc(x1, x2, get)
    # upstream's assert_close_matrices: relative Frobenius error
    error = float(jnp.linalg.norm(exact - empirical) / jnp.linalg.norm(exact))
    assert error < 0.1, error


PARALLEL = {
    # upstream test_parallel_in: two inputs, a Dense on each, summed
    "parallel_in": (
        lambda: stax.serial(
            stax.parallel(stax.Dense(128), stax.Dense(128)), stax.FanInSum(), stax.Dense(1)
        ),
        (jnp.ones((4, 2)), jnp.ones((4, 3))),
    ),
    # upstream test_parallel_out: two outputs
    "parallel_out": (
        lambda: stax.serial(
            stax.Dense(1024), stax.FanOut(2), stax.parallel(stax.Dense(1), stax.Dense(1))
        ),
        jnp.ones((4, 1)),
    ),
}


@pytest.mark.parametrize("name", sorted(PARALLEL))
@pytest.mark.xfail(raises=NotImplementedError, strict=True, reason="several inputs or outputs")
def test_parallel_in_out(name):
    make, x = PARALLEL[name]
    make().kernel_fn(x, None, "ntk")
