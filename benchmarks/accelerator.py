"""Benchmark ``accelerator``: the headline cases on a GPU/TPU, unchanged code.

memwise is developed on CPU; this script runs the same programs on whatever accelerator
JAX finds, at the sizes of the user reports: attention at L=16,384 (against ``jax.nn``'s
``dot_product_attention``, which may use cuDNN), the log-sum-exp reduction at
n=m=50,000, the Sinkhorn divergence gradient of OTT-JAX issue 417 at n=50,000 and the
LSTM of the Flax nn.remat discussion at T=10,000. On a CPU-only machine it says so and
does nothing.
"""

from __future__ import annotations

import harness
import jax
import jax.numpy as jnp
import pairwise

import memwise as mw


def _lstm_table(quick: bool) -> dict:
    from memwise.scenarios import lstm

    size = dict(
        batch=10,
        seq_length=1000 if quick else 10_000,
        hidden=128,
        input_dim=32,
        output_dim=4,
        seq2seq=True,
    )
    x, y = lstm.data(
        size["batch"], size["seq_length"], size["input_dim"], size["output_dim"], size["seq2seq"]
    )
    shape = dict(hidden=size["hidden"], output_dim=size["output_dim"], seq2seq=True)
    nets = {
        "nn.scan": lstm.model("scan", **shape),
        "nn.scan(nn.remat)": lstm.model("remat", **shape),
        "memwise.flax.scan (default c)": lstm.model("memwise", **shape),
        "memwise.flax.scan (c=16)": lstm.model("memwise", checkpoints=16, **shape),
    }
    params = nets["nn.scan"].init(jax.random.PRNGKey(0), x[:, :2])["params"]
    variants = [
        harness.Variant(name, jax.value_and_grad(lstm.loss_fn(net)), (params, x, y))
        for name, net in nets.items()
    ]
    return harness.run_table(
        f"LSTM seq2seq, T={size['seq_length']}, batch 10, hidden 128",
        variants,
        baseline="nn.scan",
        quick=quick,
    )


def _attention_table(quick: bool) -> dict:
    length = 4096 if quick else 16_384
    key = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(kk, (1, 8, length, 64), jnp.float32) for kk in key)
    grad = lambda f: jax.value_and_grad(f, argnums=(0, 1, 2))  # noqa: E731
    variants = [
        harness.Variant("dense: value_and_grad", grad(pairwise.attn_dense), (q, k, v)),
        harness.Variant(
            "jax.nn.dot_product_attention: value_and_grad", grad(pairwise.attn_jax_nn), (q, k, v)
        ),
        harness.Variant("memwise: forward", pairwise.attn_memwise, (q, k, v)),
        harness.Variant("memwise: value_and_grad", grad(pairwise.attn_memwise), (q, k, v)),
        harness.Variant(
            "memwise causal: value_and_grad", grad(pairwise.attn_memwise_causal), (q, k, v)
        ),
    ]
    return harness.run_table(
        f"attention, 8 heads, L={length}, d=64, float32",
        variants,
        baseline="dense: value_and_grad",
        quick=quick,
    )


def _lse_table(quick: bool) -> dict:
    n = 20_000 if quick else 50_000  # dense value_and_grad holds a few n x n matrices
    x = jax.random.normal(jax.random.PRNGKey(0), (n, 3))
    y = jax.random.normal(jax.random.PRNGKey(1), (n, 3))
    grad = lambda f: jax.value_and_grad(f, argnums=(0, 1))  # noqa: E731
    variants = [
        harness.Variant("dense JAX: value_and_grad", grad(pairwise.lse_dense), (x, y)),
        harness.Variant("memwise: forward", pairwise.lse_memwise, (x, y)),
        harness.Variant("memwise: value_and_grad", grad(pairwise.lse_memwise), (x, y)),
    ]
    return harness.run_table(
        f"log-sum-exp of a squared-Euclidean cost, n=m={n}",
        variants,
        baseline="memwise: forward",
        quick=quick,
    )


def _sinkhorn_table(quick: bool) -> dict:
    from memwise.scenarios import pointcloud

    n = 10_000 if quick else 50_000
    x, y = pointcloud.report_clouds(n)
    loss = jax.value_and_grad(lambda x, y: mw.ot.sinkhorn_divergence(x, y))
    variants = [harness.Variant("memwise sinkhorn_divergence: value_and_grad (x)", loss, (x, y))]
    title = f"OTT-JAX issue 417: Sinkhorn divergence of discs r=5, r=10, n=m={n}"
    table = harness.run_table(title, variants, baseline=variants[0].name, quick=quick, repeats=3)
    value, _ = jax.jit(loss)(x, y)
    table["rows"][0]["divergence"] = float(value)
    return table


def main(quick: bool = False) -> None:
    backend = jax.default_backend()
    if backend == "cpu":
        print("benchmark 'accelerator': no GPU/TPU found (backend cpu); nothing to do")
        return
    tables = []
    device = jax.devices()[0].device_kind
    notes = f"On {device}. " + __doc__.split("\n\n")[1].replace("\n", " ")
    for build in (_attention_table, _lse_table, _sinkhorn_table, _lstm_table):
        table = build(quick)
        harness.print_table(table)
        tables.append(table)
        harness.save("accelerator", tables, quick=quick, notes=notes)  # keep partial runs


if __name__ == "__main__":
    harness.cli(main)
