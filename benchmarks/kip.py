"""Benchmark ``kip``: gradient memory of a KIP loss as the target set grows, the problem
of the neural-tangents question "Question regarding OOM issues" (60,000 targets).

The report's setting: 100 support images 28x28x1, the infinite-width NTK of
Conv(3x3)-Relu-Conv(3x3)-Relu-Flatten-Dense, the gradient of the KIP loss w.r.t. the
support images and labels. Compiled only (XLA ``memory_analysis``), at 500 ... 60,000
targets: the dense program (the KIP notebook's loss, the whole target-by-support kernel
at once) and ``mw.ntk.kip_loss`` in (500 targets x 10 support) tiles. neural-tangents
0.6.5's figures (tests/data/neural_tangents_kernels.README.md, same architecture and
sizes, measured on jax 0.4.30) are the anchor. A second table varies the support tile at
6,000 targets (a tile of the whole support set is "chunking the targets only"); a third
times the dense and tiled gradients at 500 targets, where both run. A fourth table
compiles the KIP paper's other architectures, a Myrtle-style kernel (conv, relu, 2x2
average pooling) and a small residual kernel (global average pooling), at 6,000 and
60,000 targets with the default ("auto") tiles: their pooling needs each pair's
pixel-by-pixel covariance, (28*28)^2 floats. A fifth times the Myrtle-style kernel's
gradient at CIFAR size (32x32x3), dense and in "auto" tiles (one pair per tile there).
"""

from __future__ import annotations

import functools

import harness
import jax
import jax.numpy as jnp

from memwise.ntk import kip_loss
from memwise.scenarios import kip

SUPPORT, SIDE, CLASSES = 100, 28, 10
# neural-tangents 0.6.5, gradient temp of the same KIP loss
# (tests/data/neural_tangents_kernels.README.md).
NEURAL_TANGENTS_MIB = {500: 1500, 1000: 2999, 2000: 5996}
MIB = 2**20


def _shapes(n_target: int):
    s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    return (
        s(SUPPORT, SIDE, SIDE, 1),
        s(SUPPORT, CLASSES),
        s(n_target, SIDE, SIDE, 1),
        s(n_target, CLASSES),
    )


def _tiled(chunk_size, kernel_name="conv"):
    kernel = kip.KERNELS[kernel_name]()

    def loss(xs, ys, xt, yt):
        return kip_loss(kernel, xs, ys, xt, yt, ridge=kip.RIDGE, chunk_size=chunk_size)

    return jax.value_and_grad(loss, argnums=(0, 1))


_DENSE = jax.value_and_grad(kip.naive_loss, argnums=(0, 1))


def main(quick: bool = False) -> None:
    targets = [500, 6000] if quick else [500, 1000, 2000, 6000, 60_000]
    dense_targets = [500] if quick else [500, 1000, 2000, 6000]
    variants = []
    for n in dense_targets:
        extra = {"targets": n, "neural-tangents temp MiB": NEURAL_TANGENTS_MIB.get(n)}
        variants.append(
            harness.Variant(f"dense, {n:,} targets", _DENSE, _shapes(n), extra, run=False)
        )
    for n in targets:
        extra = {"targets": n, "neural-tangents temp MiB": NEURAL_TANGENTS_MIB.get(n)}
        variants.append(
            harness.Variant(
                f"mw.ntk.kip_loss (500, 10), {n:,} targets",
                _tiled((500, 10)),
                _shapes(n),
                extra,
                run=False,
            )
        )
    by_targets = harness.run_table(
        "KIP gradient vs number of targets (compiled only; 100 support images 28x28x1)",
        variants,
        baseline=variants[0].name,
        quick=quick,
        time=False,
    )
    harness.print_table(by_targets)

    tiles = [(500, 5), (500, 10), (500, 25), (500, 100)] if not quick else [(500, 10), (500, 100)]
    tile_variants = [
        harness.Variant(
            f"tiles {t}", _tiled(t), _shapes(6000), {"support per tile": t[1]}, run=False
        )
        for t in tiles
    ]
    by_tile = harness.run_table(
        "KIP gradient at 6,000 targets vs the support tile (500 targets per tile; "
        "(500, 100) = chunking the targets only)",
        tile_variants,
        baseline=tile_variants[-1].name,
        quick=quick,
        time=False,
    )
    harness.print_table(by_tile)

    data = kip.data(SUPPORT, 500, SIDE)
    timed = harness.run_table(
        "KIP value and gradient at 500 targets, run (100 support images 28x28x1)",
        [
            harness.Variant("dense", _DENSE, data),
            harness.Variant("mw.ntk.kip_loss (500, 10)", _tiled((500, 10)), data),
            harness.Variant("mw.ntk.kip_loss (500, 25)", _tiled((500, 25)), data),
        ],
        baseline="dense",
        quick=quick,
        repeats=3 if quick else 5,
    )
    harness.print_table(timed)
    pooled_targets = [6000] if quick else [6000, 60_000]
    pooled_variants = [
        harness.Variant(
            f"{name} kernel, auto tiles, {n:,} targets",
            _tiled("auto", name),
            _shapes(n),
            {"targets": n},
            run=False,
        )
        for name in ("myrtle", "resnet")
        for n in pooled_targets
    ]
    pooled = harness.run_table(
        "KIP gradient with pooling kernels vs number of targets (compiled only; 100 support "
        "images 28x28x1; Myrtle-style and small residual kernels)",
        pooled_variants,
        baseline=pooled_variants[0].name,
        quick=quick,
        time=False,
    )
    harness.print_table(pooled)
    cifar = kip.data(2, 8, 32, channels=3)
    dense_myrtle = functools.partial(kip.naive_loss, kernel="myrtle")
    pooled_timed = harness.run_table(
        "Myrtle-style kernel's KIP gradient at CIFAR size, run (2 support and 8 target "
        "images 32x32x3)",
        [
            harness.Variant("dense", jax.value_and_grad(dense_myrtle, argnums=(0, 1)), cifar),
            harness.Variant("mw.ntk.kip_loss, auto tiles", _tiled("auto", "myrtle"), cifar),
        ],
        baseline="dense",
        quick=quick,
        repeats=1 if quick else 3,
    )
    harness.print_table(pooled_timed)
    harness.save(
        "kip",
        [by_targets, by_tile, timed, pooled, pooled_timed],
        notes=__doc__.split("\n\n")[0],
        quick=quick,
    )


if __name__ == "__main__":
    harness.cli(main)
