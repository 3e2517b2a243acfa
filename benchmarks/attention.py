"""Benchmark ``dot_product_attention``: memwise's tiled drop-in against
``jax.nn.dot_product_attention(implementation="xla")``, measured in one run.

Tables: T = 1,024 / 4,096 / 16,384, N = 8 query heads, H = 64, batch 1, causal and not,
multi-head (8 K/V heads) and 8:1 grouped-query (1 K/V head): compiled temp of the
forward and of value_and_grad, forward time, backward/forward time ratio. Then a sliding
window of W = 512 keys at T = 16,384 against full (and causal) attention, and a packed batch
of 8 sequences of random lengths in T = 8,192 checked against each sequence alone.

Targets: gradient temp under 64 MiB at T = 16,384 for every option (GQA included);
forward within 1.2x of jax.nn where jax.nn fits; value_and_grad at most 2.5x + 1 of the
forward (backward/forward <= 2.5, FlashAttention-2's); the window's time at most 1.3x of
(T W) / T^2 times the full attention's (skipped tiles cost nothing); the packed batch
equal to the sequences alone.

``MEMWISE_BENCH_MEMORY_ONLY=1`` compiles only (inputs are shapes, nothing runs).
jax.nn at T = 16,384 (an 8 GiB score matrix per pass) is compiled only.
"""

from __future__ import annotations

import harness
import jax
import jax.numpy as jnp
import numpy as np

import memwise as mw

HEADS, DIM = 8, 64
LENGTHS = (1_024, 4_096, 16_384)
WINDOW = 512


def _loss(out):
    # sum(out ** 2): with sum(out) XLA folds the softmax's row sums away.
    return jnp.sum(out**2)


def jax_nn(q, k, v, **kw):
    return _loss(jax.nn.dot_product_attention(q, k, v, implementation="xla", **kw))


def memwise(q, k, v, **kw):
    return _loss(mw.dot_product_attention(q, k, v, **kw))


def _inputs(T, kv_heads, concrete):
    shapes = [(1, T, HEADS, DIM), (1, T, kv_heads, DIM), (1, T, kv_heads, DIM)]
    if not concrete:
        return tuple(jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes)
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    return tuple(jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, shapes))


def _program(fn, grad, **kw):
    f = lambda q, k, v: fn(q, k, v, **kw)  # noqa: E731
    return jax.value_and_grad(f, (0, 1, 2)) if grad else f


def _backward_over_forward(table):
    """value_and_grad time over forward time, per implementation (None if not timed)."""
    times = {r["variant"]: r["time_s"] for r in table["rows"]}
    for row in table["rows"]:
        name, _, kind = row["variant"].partition(": ")
        fwd = times.get(f"{name}: forward")
        if kind == "value_and_grad" and row["time_s"] and fwd:
            row["value_and_grad / forward"] = row["time_s"] / fwd


def attention_tables(quick):
    concrete = not harness.MEMORY_ONLY
    tables = []
    for T in LENGTHS[:1] if quick else LENGTHS:
        for kv_heads in (HEADS, 1):
            args = _inputs(T, kv_heads, concrete)
            for causal in (False, True):
                variants = []
                for name, fn in (("jax.nn (xla)", jax_nn), ("memwise", memwise)):
                    fits = name == "memwise" or T <= 4_096
                    for grad in (False, True):
                        variants.append(
                            harness.Variant(
                                f"{name}: {'value_and_grad' if grad else 'forward'}",
                                _program(fn, grad, is_causal=causal),
                                args,
                                run=fits,
                            )
                        )
                kind = "MHA" if kv_heads == HEADS else f"GQA {HEADS}:{kv_heads}"
                table = harness.run_table(
                    f"attention T = {T:,}, N = {HEADS}, H = {DIM}, {kind}, "
                    f"{'causal' if causal else 'not causal'} (float32)",
                    variants,
                    baseline="memwise: forward",
                    quick=quick,
                )
                _backward_over_forward(table)
                harness.print_table(table)
                tables.append(table)
    return tables


def window_table(quick):
    T = 4_096 if quick else 16_384
    args = _inputs(T, HEADS, not harness.MEMORY_ONLY)
    variants = [
        harness.Variant("memwise full: forward", _program(memwise, False), args),
        harness.Variant("memwise causal: forward", _program(memwise, False, is_causal=True), args),
        harness.Variant(
            f"memwise causal, window {WINDOW}: forward",
            _program(memwise, False, is_causal=True, local_window_size=(WINDOW, 0)),
            args,
            extra={"work fraction (T W / T^2)": WINDOW / T},
        ),
        harness.Variant(
            f"memwise causal, window {WINDOW}: value_and_grad",
            _program(memwise, True, is_causal=True, local_window_size=(WINDOW, 0)),
            args,
        ),
    ]
    table = harness.run_table(
        f"sliding window W = {WINDOW}, T = {T:,}, N = {HEADS}, H = {DIM} (float32)",
        variants,
        baseline="memwise full: forward",
        quick=quick,
    )
    harness.print_table(table)
    return table


def packed_check(quick):
    """Max deviation of a packed batch (segment ids) from each sequence alone."""
    T = 1_024 if quick else 8_192
    rng = np.random.default_rng(0)
    cuts = np.sort(rng.choice(np.arange(1, T), 7, replace=False))
    lengths = np.diff(np.concatenate([[0], cuts, [T]]))
    seg = jnp.asarray(np.repeat(np.arange(8), lengths))[None]
    q, k, v = _inputs(T, 1, True)

    def packed(q, k, v):
        return mw.dot_product_attention(q, k, v, is_causal=True, q_segment_ids=seg)

    out, vjp = jax.vjp(jax.jit(packed), q, k, v)
    grads = vjp(jnp.cos(out))
    worst = 0.0
    start = 0
    for n in lengths:
        part = slice(start, start + int(n))
        alone, vjp1 = jax.vjp(
            lambda a, b, c: mw.dot_product_attention(a, b, c, is_causal=True),
            q[:, part],
            k[:, part],
            v[:, part],
        )
        worst = max(worst, float(jnp.max(jnp.abs(out[:, part] - alone))))
        for g, g1 in zip(grads, vjp1(jnp.cos(out[:, part]))):
            worst = max(worst, float(jnp.max(jnp.abs(g[:, part] - g1))))
        start += int(n)
    print(f"packed batch, T = {T:,}, lengths {lengths.tolist()}: max deviation {worst:.2e}")
    return {"T": T, "lengths": lengths.tolist(), "max_abs_deviation": worst}


def main(quick: bool = False) -> None:
    tables = attention_tables(quick) + [window_table(quick)]
    packed = None if harness.MEMORY_ONLY else packed_check(quick)
    harness.save(
        "attention",
        tables,
        notes=(
            "Every variant's loss is sum(out ** 2); batch 1, float32, chunk_size='auto'. "
            "jax.nn at T = 16,384 is compiled only (its score matrix is 8 GiB per pass). "
            "memwise reads the (B, T, N, H) inputs in place, every head inside each tile. "
            "At T = 16,384 the gradient temp is the loss's cotangent of the output "
            "(32 MiB), the log-sum-exp and the tiles: the output kept for the backward "
            "dies into a gradient buffer once rowsum(dO * O) is formed (dQ's with one "
            "K/V head, dK's or dV's with 8). "
            + ("" if packed is None else f"Packed batch vs each sequence alone: {packed}.")
        ),
        quick=quick,
    )


if __name__ == "__main__":
    harness.cli(main)
