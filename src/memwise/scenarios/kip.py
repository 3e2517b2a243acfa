"""Scenario ``kip``: the gradient of a KIP loss with a 2-layer conv NTK.

From the neural-tangents question "Question regarding OOM issues": the user learns 100
support images (28x28x1, MNIST-sized) by kernel inducing points (Nguyen et al. 2021)
against 60,000 targets with the infinite-width NTK of
Conv(3x3)-Relu-Conv(3x3)-Relu-Flatten-Dense, and runs out of memory: neural-tangents'
gradient needs about 3 MiB of temporaries per target image (176 GiB at 60,000). The
naive program is the KIP notebook's loss written densely (the whole target-by-support
kernel at once, ``jnp.linalg.solve``), on memwise's kernels since neural-tangents does
not import on current JAX; the memwise program is :func:`memwise.ntk.kip_loss`, which
tiles targets and support and recomputes tiles in the backward pass.

The KIP paper's other architectures run the same way (``make(..., kernel=...)``):
``"myrtle"``, a Myrtle-style kernel (Shankar et al. 2020: conv, relu and 2x2 average
pooling), and ``"resnet"``, a small residual kernel (a conv stem, one block
``x + Conv(Relu(x))``, global average pooling). Pooling needs the pixel-by-pixel
covariance of every pair of images before it, (28*28)^2 numbers per pair, so their tiles
are much smaller than the conv/flatten kernel's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from memwise.ntk import kernels, kip_loss
from memwise.scenarios import Scenario

SIZES = {
    "default": dict(n_support=10, n_target=200, side=14, chunk_size=(50, 5)),
    "report": dict(n_support=100, n_target=60_000, side=28, chunk_size=(500, 10)),
}

RIDGE = 1e-6


def kernel_fn() -> kernels.KernelFn:
    """The report's network: stax.Conv(64,(3,3),SAME) Relu, twice, Flatten, Dense(10)."""
    k = kernels
    return k.serial(k.Conv((3, 3)), k.Relu(), k.Conv((3, 3)), k.Relu(), k.Flatten(), k.Dense())


def myrtle_kernel_fn() -> kernels.KernelFn:
    """Myrtle-style: Conv Relu Conv Relu AvgPool(2x2) Conv Relu AvgPool(2x2) Flatten Dense."""
    k = kernels
    pool = k.AvgPool((2, 2), strides=(2, 2))
    return k.serial(
        k.Conv((3, 3)),
        k.Relu(),
        k.Conv((3, 3)),
        k.Relu(),
        pool,
        k.Conv((3, 3)),
        k.Relu(),
        pool,
        k.Flatten(),
        k.Dense(),
    )


def resnet_kernel_fn() -> kernels.KernelFn:
    """A small residual network: Conv, x + Conv(Relu(x)), Relu, GlobalAvgPool, Dense."""
    k = kernels
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


KERNELS = {"conv": kernel_fn, "myrtle": myrtle_kernel_fn, "resnet": resnet_kernel_fn}


def naive_loss(x_support, y_support, x_target, y_target, ridge=RIDGE, kernel="conv"):
    """The KIP notebook's ``loss_fn``: the whole kernel at once, regulariser by the trace."""
    kernel = KERNELS[kernel]()
    k_ss = kernel(x_support, x_support)
    k_ts = kernel(x_target, x_support)
    n = k_ss.shape[0]
    k_ss_reg = k_ss + jnp.abs(ridge) * jnp.trace(k_ss) * jnp.eye(n) / n
    pred = k_ts @ jnp.linalg.solve(k_ss_reg, y_support)
    return 0.5 * jnp.mean((pred - y_target) ** 2)


def data(
    n_support: int, n_target: int, side: int, classes: int = 10, channels: int = 1
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Random images standing in for MNIST (or CIFAR, ``channels=3``), one-hot labels
    (centred as in KIP)."""
    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    x_support = jax.random.normal(keys[0], (n_support, side, side, channels))
    x_target = jax.random.normal(keys[1], (n_target, side, side, channels))
    one_hot = lambda n: jax.nn.one_hot(jnp.arange(n) % classes, classes) - 1.0 / classes  # noqa: E731
    return x_support, one_hot(n_support), x_target, one_hot(n_target)


def make(
    n_support: int, n_target: int, side: int, chunk_size: tuple[int, int], kernel: str = "conv"
) -> Scenario:
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {sorted(KERNELS)}, got {kernel!r}")
    kernel_fn = KERNELS[kernel]()

    def memwise_loss(x_support, y_support, x_target, y_target):
        return kip_loss(
            kernel_fn, x_support, y_support, x_target, y_target, ridge=RIDGE, chunk_size=chunk_size
        )

    return Scenario(
        name="kip",
        description=(
            f"grad of a KIP loss, {kernel} NTK, {n_support} support and {n_target:,} "
            f"target images {side}x{side}x1, tiles {chunk_size}"
        ),
        naive=jax.value_and_grad(functools.partial(naive_loss, kernel=kernel), argnums=(0, 1)),
        memwise=jax.value_and_grad(memwise_loss, argnums=(0, 1)),
        args=data(n_support, n_target, side),
        rtol=1e-3,
        atol=1e-6,
    )
