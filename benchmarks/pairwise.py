"""Benchmark ``pairwise``: log-sum-exp of a squared-Euclidean cost and softmax attention,
with gradients: dense JAX, ``lax.map(batch_size=)``, an OTT-style chunked scan (forward
chunked, reverse mode keeps every chunk, as in OTT-JAX issue 417) and memwise, measured
in one run.

Targets: gradient temp within 2x of the forward's and < 64 MiB at n=m=20,000
(OTT 0.6.0: 4,579 MiB); attention at L=16,384, d=64: gradient temp < 128 MiB; gradient
wall time <= 3x the forward's and no slower than dense where dense fits.
"""

from __future__ import annotations

import subprocess
import sys

import harness
import jax
import jax.numpy as jnp

import memwise as mw
from memwise.measure import format_bytes

BATCH = 1000  # the chunk size of the lax.map and OTT-style variants


def cost(a, b):
    return jnp.sum((a - b) ** 2)


def lse_dense(x, y):
    c = jnp.sum((x[:, None, :] - y[None, :, :]) ** 2, -1)
    return jnp.sum(jax.nn.logsumexp(-c, axis=1))


def lse_lax_map(x, y):
    rows = jax.lax.map(
        lambda xi: jax.nn.logsumexp(-jax.vmap(cost, (None, 0))(xi, y)), x, batch_size=BATCH
    )
    return jnp.sum(rows)


def lse_ott_scan(x, y):
    # The pattern of ott.geometry.pointcloud's online mode: a scan over row chunks with a
    # dense chunk inside, no jax.checkpoint: reverse mode stores every chunk.
    xs = x.reshape(-1, BATCH, x.shape[1])

    def body(carry, xb):
        c = jnp.sum((xb[:, None, :] - y[None, :, :]) ** 2, -1)
        return carry + jnp.sum(jax.nn.logsumexp(-c, axis=1)), None

    total, _ = jax.lax.scan(body, jnp.zeros((), x.dtype), xs)
    return total


def lse_memwise(x, y):
    return jnp.sum(
        mw.pairwise_reduce(lambda a, b: -cost(a, b), x, y, reduce="logsumexp", chunk_size="auto")
    )


# Every attention variant ends in the same loss, sum(out ** 2): with sum(out) XLA folds
# sum_i softmax(s)_ij away and the dense forward never forms the score matrix.
def _loss(out):
    return jnp.sum(out**2)


def attn_dense(q, k, v):
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / jnp.sqrt(q.shape[-1])
    return _loss(jax.nn.softmax(s, axis=-1) @ v)


def attn_jax_nn(q, k, v):
    t = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731  (B, L, H, D) layout
    return _loss(jax.nn.dot_product_attention(t(q), t(k), t(v)))


def attn_memwise(q, k, v):
    return _loss(mw.attention(q, k, v))


def attn_memwise_causal(q, k, v):
    return _loss(mw.attention(q, k, v, causal=True))


ATTENTION = {
    "dense softmax": attn_dense,
    "jax.nn.dot_product_attention": attn_jax_nn,
    "memwise": attn_memwise,
    "memwise causal": attn_memwise_causal,
}
LENGTH, DIM = 16_384, 64


def _grad(fn, argnums):
    return jax.value_and_grad(fn, argnums)


def _attention_inputs():
    keys = jax.random.split(jax.random.PRNGKey(1), 3)
    return tuple(jax.random.normal(kk, (1, 1, LENGTH, DIM), jnp.float32) for kk in keys)


def _attention_program(name: str, grad: bool):
    fn = ATTENTION[name]
    return _grad(fn, (0, 1, 2)) if grad else fn


def _rss_child(name: str, grad: bool) -> None:
    """Print how much the peak RSS grows while the compiled program runs once."""
    args = jax.block_until_ready(_attention_inputs())
    exe = jax.jit(_attention_program(name, grad)).lower(*args).compile()
    before = harness.peak_rss_bytes()
    jax.block_until_ready(exe(*args))
    print(harness.peak_rss_bytes() - before)


def run_rss_growth(name: str, grad: bool) -> str:
    """Peak-RSS growth of one run in a fresh process (XLA:CPU may compile a whole dense
    program into one YNNPACK fusion whose scratch memory_analysis does not report)."""
    proc = subprocess.run(
        [sys.executable, __file__, "--rss-child", name, "grad" if grad else "forward"],
        capture_output=True,
        text=True,
        check=True,
    )
    return format_bytes(int(proc.stdout.split()[-1]))


def main(quick: bool = False) -> None:
    n = 20_000
    key_x, key_y = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(key_x, (n, 2), jnp.float32)
    y = jax.random.normal(key_y, (n, 2), jnp.float32) * 2.0 + 1.0
    big = jax.ShapeDtypeStruct((100_000, 2), jnp.float32)
    grad = lambda f: _grad(f, (0, 1))  # noqa: E731
    # Quick mode runs only memwise and dense (the others are compiled for their memory).
    slow = not quick
    lse = harness.run_table(
        f"logsumexp of -|x_i - y_j|^2 over j, n = m = {n:,}, d = 2 (float32)",
        [
            harness.Variant("dense JAX: forward", lse_dense, (x, y)),
            harness.Variant("dense JAX: value_and_grad", grad(lse_dense), (x, y)),
            harness.Variant(
                f"lax.map(batch_size={BATCH}): value_and_grad", grad(lse_lax_map), (x, y), run=slow
            ),
            harness.Variant(
                f"OTT-style chunked scan ({BATCH} rows, no remat): value_and_grad",
                grad(lse_ott_scan),
                (x, y),
                run=slow,
            ),
            harness.Variant("memwise: forward", lse_memwise, (x, y)),
            harness.Variant("memwise: value_and_grad", grad(lse_memwise), (x, y)),
            harness.Variant("memwise n = m = 100,000: forward", lse_memwise, (big, big), run=False),
            harness.Variant(
                "memwise n = m = 100,000: value_and_grad", grad(lse_memwise), (big, big), run=False
            ),
        ],
        baseline="memwise: forward",
        quick=quick,
    )
    harness.print_table(lse)

    qkv = _attention_inputs()
    variants = []
    # memwise causal: the tiles above the diagonal are skipped (about half the work)
    for name in ATTENTION:
        run = slow or not name.startswith("jax.nn")
        for grad_ in (False, True):
            rss = run_rss_growth(name, grad_) if run else None
            variants.append(
                harness.Variant(
                    f"{name}: {'value_and_grad' if grad_ else 'forward'}",
                    _attention_program(name, grad_),
                    qkv,
                    run=run,
                    extra={"run peak RSS growth": rss},
                )
            )
    attn = harness.run_table(
        f"softmax attention, L = {LENGTH:,}, d = {DIM}, 1 head (float32)",
        variants,
        baseline="memwise: forward",
        quick=quick,
    )
    harness.print_table(attn)
    harness.save(
        "pairwise",
        [lse, attn],
        notes=(
            "memwise tiles chosen by chunk_size='auto'. Every attention variant's loss is "
            "sum(out ** 2). XLA:CPU compiles the dense softmax forward into one YNNPACK "
            "fusion whose 1 GiB score matrix is scratch inside the fusion, invisible to "
            "memory_analysis (temp 0 B): the 'run peak RSS growth' column (one run in a "
            "fresh process) shows it. "
            "Rows with run=False are compiled "
            "only (memory from compiled_memory); in quick mode lax.map, the OTT-style scan "
            "and jax.nn.dot_product_attention are compiled only."
        ),
        quick=quick,
    )


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--rss-child":
        _rss_child(sys.argv[2], sys.argv[3] == "grad")
    else:
        harness.cli(main)
