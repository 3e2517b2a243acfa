"""memwise.nt beyond stax: what neural-tangents has and memwise.nt does not is named."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import memwise.nt as nt
from memwise.nt import predict, stax

_, F, _ = stax.serial(stax.Dense(4), stax.Relu(), stax.Dense(2))
PARAMS = stax.serial(stax.Dense(4), stax.Relu(), stax.Dense(2)).init_fn(
    __import__("jax").random.PRNGKey(0), (-1, 3)
)[1]
X = jnp.ones((2, 3))

BAD = {
    "nt.Kernel": (lambda: nt.Kernel, NotImplementedError, "nt.Kernel"),
    "nt.experimental": (lambda: nt.experimental, NotImplementedError, "experimental"),
    "ODEState": (lambda: predict.ODEState, NotImplementedError, "ODEState"),
    "Dropout": (lambda: stax.Dropout(0.5), NotImplementedError, "stax.Dropout"),
    "implementation": (
        lambda: nt.empirical_ntk_fn(F, implementation=7),
        ValueError,
        "implementation",
    ),
    "vmap_axes": (
        lambda: nt.empirical_ntk_fn(F, vmap_axes=((0, 1), 0, {})),
        NotImplementedError,
        "vmap_axes",
    ),
    "rng": (lambda: nt.empirical_ntk_fn(F)(X, None, PARAMS, rng=1), NotImplementedError, "rng"),
    "trace_axes": (
        lambda: nt.empirical_ntk_fn(F, trace_axes=(5,))(X, None, PARAMS),
        ValueError,
        "trace_axes",
    ),
    "pixel output": (
        lambda: stax.Conv(4, (3, 3)).kernel_fn(jnp.ones((2, 5, 5, 1)), None, "ntk"),
        NotImplementedError,
        "pixel",
    ),
    "several inputs": (
        lambda: stax.Dense(1).kernel_fn((X, X), None, "ntk"),
        NotImplementedError,
        "several inputs",
    ),
    "ensemble absolute": (
        lambda: predict.gradient_descent_mse_ensemble(
            stax.Dense(1).kernel_fn, X, jnp.ones((2, 1)), diag_reg_absolute_scale=True
        ),
        NotImplementedError,
        "diag_reg_absolute_scale",
    ),
    "negative time in an array": (
        lambda: predict.gradient_descent_mse_ensemble(stax.Dense(1).kernel_fn, X, jnp.ones((2, 1)))(
            t=jnp.array([1.0, -1.0]), x_test=X, get="ntk"
        ),
        ValueError,
        "t must be >= 0",
    ),
    "negative time on the training inputs": (
        lambda: predict.gradient_descent_mse_ensemble(stax.Dense(1).kernel_fn, X, jnp.ones((2, 1)))(
            t=np.array([1.0, -50.0]), get="ntk"
        ),
        ValueError,
        "t must be >= 0",
    ),
    "string times": (
        lambda: predict.gradient_descent_mse_ensemble(stax.Dense(1).kernel_fn, X, jnp.ones((2, 1)))(
            t=np.array(["a", "b"]), x_test=X, get="ntk"
        ),
        TypeError,
        "t must be None",
    ),
    "get": (lambda: predict.gp_inference(jnp.eye(2), jnp.ones((2, 1)))("nntk"), ValueError, "get"),
    "y_train": (
        lambda: predict.gradient_descent_mse(jnp.eye(2), jnp.ones(2)),
        ValueError,
        "y_train",
    ),
    "monte carlo n_samples": (
        lambda: nt.monte_carlo_kernel_fn(None, F, None, 0),
        ValueError,
        "n_samples",
    ),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_and_unsupported_names(name):
    call, error, words = BAD[name]
    with pytest.raises(error) as info:
        call()
    assert words in str(info.value), str(info.value)


def test_empirical_kernel_keywords_reach_f():
    # neural-tangents passes apply_fn keywords through (the same for x1 and x2).
    def f(p, x, scale=1.0):
        return scale * (x @ p)

    p = jnp.ones((3, 2))
    one = nt.empirical_ntk_fn(f, vmap_axes=0)(X, None, p)
    two = nt.empirical_ntk_fn(f, vmap_axes=0)(X, None, p, scale=2.0)
    np.testing.assert_allclose(two, 4 * one, rtol=1e-6)


def test_a_batched_kernel_gradient_is_flat_in_the_targets():
    # The KIP question's program: nt.batch's tiles are tiled in the backward pass too, so
    # 10x the targets add only the (targets, support) kernel and its cotangent.
    from memwise.measure import compiled_memory

    _, _, kernel_fn = stax.serial(
        stax.Conv(8, (3, 3), padding="SAME"), stax.Relu(), stax.Flatten(), stax.Dense(1)
    )
    kernel_fn = nt.batch(kernel_fn, batch_size=10)

    def loss_fn(x_support, x_target):
        k_ts = kernel_fn(x_target, x_support, "ntk")
        return jnp.sum(
            k_ts @ jnp.linalg.solve(kernel_fn(x_support, None, "ntk"), x_support[:, 0, 0])
        )

    def temp(n):
        shapes = (
            jax.ShapeDtypeStruct((10, 8, 8, 2), jnp.float32),
            jax.ShapeDtypeStruct((n, 8, 8, 2), jnp.float32),
        )
        return compiled_memory(loss_fn, *shapes, grad=True).temp_bytes

    small, large = temp(200), temp(2_000)
    assert large - small <= 4 * 1_800 * 10 * 4, (small, large)
    # The dense gradient holds every pair's per-pixel covariances: far more.
    assert small < 4 * 200 * 10 * 64 * 4 * 2
