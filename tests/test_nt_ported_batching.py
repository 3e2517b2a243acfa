"""neural-tangents 0.6.5's tests/batching_test.py, ported to memwise.nt.

``nt.batch(kernel_fn, batch_size)`` against ``kernel_fn`` unbatched (upstream's
testSerial / testAutomatic, which are the same check here: memwise.nt.batch has one
implementation, the tile loop), for upstream's empirical NTKs (1, 2, 3 logits) and its
analytic kernels, on its sizes. Upstream's batch sizes must divide the sets; memwise's
need not (test_batch_sizes_need_not_divide). Upstream's training size 8 is left out. Not ported: testParallel / testComposition and
the pmap tests (device parallelism; memwise.nt.batch takes one device), the analytic
kernels' Dropout (memwise.nt has no Dropout: upstream's ``theoretical`` kernels are run
with Identity in its place) and kernel_fn(get=None) (the Kernel object: a tuple get here).
"""

from __future__ import annotations

import functools
import itertools

import _draw
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import random

import memwise.nt as nt
from memwise.nt import stax

# neural-tangents' own tests, a conformance suite: `make test` runs it; the fast lane
# keeps memwise's tests of the same layers (test_ntk_*, test_nt_compat).
# A tenth of each grid's cases (tests/_grid.py; stratified, so every value of every
# parameter still runs in each sample; MEMWISE_TEST_GRID=full runs them all).
pytestmark = [pytest.mark.slow, pytest.mark.grid(fraction=0.1)]

TRAIN_SIZES = [2, 4]  # upstream also 8: left out to bound the compilations of one process
TEST_SIZES = [2, 16]
INPUT_SHAPES = [(16,), (4, 4, 3)]
NETWORKS = ["FLAT", "INTERMEDIATE_CONV", "POOLING"]
KERNELS = [
    "empirical_logits_1",
    "empirical_logits_2",
    "empirical_logits_3",
    "theoretical",
    "theoretical_pytree",
]


def _build_network(input_shape, network, out_logits):
    if len(input_shape) == 1:
        return stax.serial(
            stax.Dense(2, W_std=2.0, b_std=0.5),
            stax.Identity(),
            stax.Dense(out_logits, W_std=2.0, b_std=0.5),
        )
    if network == "POOLING":
        return stax.serial(
            stax.Conv(2, (2, 2), W_std=2.0, b_std=0.05),
            stax.GlobalAvgPool(),
            stax.Identity(),
            stax.Dense(out_logits, W_std=2.0, b_std=0.5),
        )
    if network == "FLAT":
        return stax.serial(
            stax.Conv(2, (2, 2), W_std=2.0, b_std=0.05),
            stax.Flatten(),
            stax.Identity(),
            stax.Dense(out_logits, W_std=2.0, b_std=0.5),
        )
    return stax.Conv(2, (2, 2), W_std=2.0, b_std=0.05)


def _kernel(kernel_type, input_shape, network):
    key = random.PRNGKey(0)
    if kernel_type.startswith("empirical"):
        init_fn, f, _ = _build_network(input_shape, network, int(kernel_type[-1]))
        _, params = init_fn(key, (-1,) + input_shape)
        # upstream: jit(empirical_ntk_fn(f, implementation=STRUCTURED_DERIVATIVES)), keys=
        kernel_fn = jax.jit(
            nt.empirical_ntk_fn(f, implementation=nt.NtkImplementation.STRUCTURED_DERIVATIVES)
        )
        return functools.partial(kernel_fn, params=params, keys=random.split(key)[1])
    _, _, kernel_fn = _build_network(input_shape, network, 1)
    get = "ntk" if kernel_type == "theoretical" else ("nngp", "ntk")
    return jax.jit(lambda x1, x2=None: kernel_fn(x1, x2, get))


def _cases():
    out = []
    for train, test, shape, network, kernel in itertools.product(
        TRAIN_SIZES, TEST_SIZES, INPUT_SHAPES, NETWORKS, KERNELS
    ):
        if len(shape) == 1 and network != "FLAT":
            continue  # upstream: "Not testing pooling on FCN inputs."
        marks = []
        if network == "INTERMEDIATE_CONV" and kernel.startswith("theoretical"):
            # a kernel of a network ending in pixels: neural-tangents' (n1, n2, H, H, W, W)
            marks.append(
                pytest.mark.xfail(
                    raises=NotImplementedError, strict=True, reason="pixel-by-pixel output kernel"
                )
            )
        if test == 16:
            marks.append(pytest.mark.slow)
        for batch_size in (2, 8):
            out.append(
                pytest.param(
                    train,
                    test,
                    shape,
                    network,
                    kernel,
                    batch_size,
                    marks=marks,
                    id=f"{train}-{test}-{shape}-{network}-{kernel}-{batch_size}",
                )
            )
    return out


# 160 cases: 5% (8) in `make test`.
@pytest.mark.grid(fraction=0.05)
@pytest.mark.parametrize(
    "train_size, test_size, input_shape, network, kernel_type, batch_size", _cases()
)
def test_automatic(train_size, test_size, input_shape, network, kernel_type, batch_size):
    _, self_split, other_split = random.split(random.PRNGKey(0), 3)
    data_self = _draw.normal(self_split, (train_size, *input_shape))
    data_other = _draw.normal(other_split, (test_size, *input_shape))
    kernel_fn = _kernel(kernel_type, input_shape, network)
    # upstream: both x2 (None and the other set) under store_on_device True and False;
    # store_on_device changes nothing here, so one x2 each.
    for store_on_device, x2 in ((True, None), (False, data_other)):
        batched = nt.batch(kernel_fn, batch_size=batch_size, store_on_device=store_on_device)
        expected, got = kernel_fn(data_self, x2), batched(data_self, x2)
        assert type(expected) is type(got)
        for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(got)):
            np.testing.assert_allclose(b, a, rtol=5e-5, atol=5e-6)


def test_batch_sizes_need_not_divide():
    # neural-tangents requires batch_size to divide both sets; memwise pads the last tile.
    _, _, kernel_fn = stax.serial(stax.Dense(8, b_std=0.1), stax.Relu(), stax.Dense(1))
    x1 = random.normal(random.PRNGKey(0), (7, 3))
    x2 = random.normal(random.PRNGKey(1), (5, 3))
    got = nt.batch(kernel_fn, batch_size=3)(x1, x2, ("nngp", "ntk"))
    expected = kernel_fn(x1, x2, ("nngp", "ntk"))
    np.testing.assert_allclose(got.ntk, expected.ntk, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got.nngp, expected.nngp, rtol=1e-6, atol=1e-7)


def test_batch_memory_is_one_tile():
    # Memory bounded by the tile: the compiled temporaries of the batched kernel do not
    # grow with the number of inputs (upstream's store_on_device was the only switch).
    _, _, kernel_fn = stax.serial(
        stax.Conv(8, (3, 3), padding="SAME"), stax.Relu(), stax.Flatten(), stax.Dense(1)
    )
    batched = nt.batch(kernel_fn, batch_size=4)

    def temp(n):
        x = jax.ShapeDtypeStruct((n, 8, 8, 3), jnp.float32)
        compiled = jax.jit(lambda a: batched(a, None, "ntk")).lower(x).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    small, large = temp(16), temp(64)
    # The result grows as n^2 (16 x): the temporaries may hold the (n, n) result once, not
    # the per-pixel intermediates of all pairs (64 * 64 * 64 pixels * 4 bytes = 1 MiB).
    assert large - small < 4 * (64 * 64 - 16 * 16) * 4 + 256 * 1024, (small, large)


@pytest.mark.parametrize("bad, error", [(-1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_batch_size_checked(bad, error):
    with pytest.raises(error, match="batch_size must be an int >= 0"):
        nt.batch(lambda a, b: a, batch_size=bad)


def test_device_count_above_one_is_named():
    with pytest.raises(NotImplementedError, match="device_count"):
        nt.batch(lambda a, b: a, batch_size=2, device_count=2)
