"""Benchmark ``cross_entropy``: a language model's output layer and loss, with gradients:
dense ``optax`` on the full logits against ``mw.linear_cross_entropy``, in one run.

Targets: at tokens = 8,192, d = 2,048, V = 128,256 (compiled only) the gradient's
temporaries (beyond the outputs dx, dW) at most 2% of the dense logits' size and flat
in V for a fixed tile; at 2,048 tokens, d = 512, V = 32,000 forward + backward at most
1.3x the dense computation's time, and faster than it where the dense version is
memory-bound (a narrow head over a large vocabulary: d = 128, V = 128,000).
"""

from __future__ import annotations

import os

import harness
import jax
import jax.numpy as jnp
import optax

import memwise as mw


def dense(layout):
    def loss(x, w, y):
        logits = x @ (w if layout == "dv" else w.T)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return loss


def tiled(layout, chunk_size="auto"):
    def loss(x, w, y):
        return mw.linear_cross_entropy(x, w, y, layout=layout, chunk_size=chunk_size)

    return loss


def _grad(fn):
    return jax.value_and_grad(fn, (0, 1))


def _abstract(tokens, d, vocab, layout):
    shape = (d, vocab) if layout == "dv" else (vocab, d)
    return (
        jax.ShapeDtypeStruct((tokens, d), jnp.float32),
        jax.ShapeDtypeStruct(shape, jnp.float32),
        jax.ShapeDtypeStruct((tokens,), jnp.int32),
    )


def _inputs(tokens, d, vocab, layout):
    kx, kw, ky = jax.random.split(jax.random.PRNGKey(0), 3)
    shape = (d, vocab) if layout == "dv" else (vocab, d)
    x = jax.random.normal(kx, (tokens, d), jnp.float32)
    w = jax.random.normal(kw, shape, jnp.float32) / d**0.5
    return x, w, jax.random.randint(ky, (tokens,), 0, vocab)


def _share(tokens, vocab):
    """The 'temp / dense logits' column: temporaries as a fraction of T x V float32."""
    return lambda row: row["temp_bytes"] / (tokens * vocab * 4)


def memory_table(tokens=8_192, d=2_048, vocab=128_256) -> dict:
    tile = (1_024, 256)  # 256 divides 128,256 and 256,512: no ragged vocabulary tile
    variants = [
        harness.Variant(
            "dense optax (d, V): value_and_grad",
            _grad(dense("dv")),
            _abstract(tokens, d, vocab, "dv"),
            run=False,
        ),
        harness.Variant(
            "memwise tied (V, d), auto tile: value_and_grad",
            _grad(tiled("vd")),
            _abstract(tokens, d, vocab, "vd"),
            run=False,
        ),
        harness.Variant(
            f"memwise tied (V, d), tile {tile}: value_and_grad",
            _grad(tiled("vd", tile)),
            _abstract(tokens, d, vocab, "vd"),
            run=False,
        ),
        harness.Variant(
            f"memwise tied (V, d), tile {tile}, V = {vocab * 2:,}: value_and_grad",
            _grad(tiled("vd", tile)),
            _abstract(tokens, d, vocab * 2, "vd"),
            run=False,
        ),
        harness.Variant(
            "memwise (d, V), auto tile: value_and_grad",
            _grad(tiled("dv")),
            _abstract(tokens, d, vocab, "dv"),
            run=False,
        ),
    ]
    table = harness.run_table(
        f"cross-entropy of x @ W, tokens = {tokens:,}, d = {d:,}, V = {vocab:,} (float32, "
        "compiled only)",
        variants,
        baseline="dense optax (d, V): value_and_grad",
        time=False,
    )
    for row in table["rows"]:
        v = vocab * 2 if f"V = {vocab * 2:,}" in row["variant"] else vocab
        row["temp / dense logits"] = f"{_share(tokens, v)(row):.2%}"
    return table


def memory_bound_table(quick: bool) -> dict:
    """A narrow head over a large vocabulary: the dense version's time goes to moving its
    logits (tokens x V) through memory more than to its matrix products."""
    tokens, d, vocab = (512, 64, 32_000) if quick else (2_048, 128, 128_000)
    args = _inputs(tokens, d, vocab, "dv")
    variants = [
        harness.Variant("dense optax dv: value_and_grad", _grad(dense("dv")), args),
        harness.Variant("memwise dv: value_and_grad", _grad(tiled("dv")), args),
    ]
    return harness.run_table(
        f"cross-entropy of x @ W, tokens = {tokens:,}, d = {d}, V = {vocab:,} (float32, "
        "memory-bound)",
        variants,
        baseline="dense optax dv: value_and_grad",
        quick=quick,
        repeats=7,
    )


def time_table(quick: bool) -> dict:
    tokens, d, vocab = (512, 256, 8_000) if quick else (2_048, 512, 32_000)
    variants = []
    for layout in ("dv", "vd"):
        args = _inputs(tokens, d, vocab, layout)
        variants.append(
            harness.Variant(f"dense optax {layout}: value_and_grad", _grad(dense(layout)), args)
        )
        variants.append(
            harness.Variant(f"memwise {layout}: value_and_grad", _grad(tiled(layout)), args)
        )
    # A taller tile than "auto"'s 8 MiB budget gives: fewer passes over W and dW.
    tall = (min(tokens, 2_048), 512)
    variants.append(
        harness.Variant(
            f"memwise dv, tile {tall}: value_and_grad",
            _grad(tiled("dv", tall)),
            _inputs(tokens, d, vocab, "dv"),
        )
    )
    table = harness.run_table(
        f"cross-entropy of x @ W, tokens = {tokens:,}, d = {d}, V = {vocab:,} (float32)",
        variants,
        baseline="dense optax dv: value_and_grad",
        quick=quick,
        repeats=7,
    )
    for row in table["rows"]:
        row["temp / dense logits"] = f"{_share(tokens, vocab)(row):.2%}"
    return table


def main(quick: bool = False) -> None:
    load_before = os.getloadavg()[0]
    tables = [memory_table(), time_table(quick), memory_bound_table(quick)]
    for table in tables:
        harness.print_table(table)
    harness.save(
        "cross_entropy",
        tables,
        notes=(
            "memwise tiles chosen by chunk_size='auto' unless a tile is named. The memory "
            "table is compiled only (memory_analysis); its temp excludes the outputs (the "
            "loss, dx and dW). Both layouts of w are read in place (each tile slices its "
            "words from w, the tile gradient is added into dW in place). Times are medians "
            f"of interleaved runs on this {os.cpu_count()}-core machine "
            f"({harness.load_span(load_before)}): ratios within the run only."
        ),
        quick=quick,
    )


if __name__ == "__main__":
    harness.cli(main)
