"""Benchmark ``accelerator``: the headline cases on a GPU, each in its own process with a
time limit, results written as they come.

memwise is developed on a 2-core CPU; the people who run out of memory do it on GPUs. This
script runs the same programs, unchanged, on the first accelerator JAX finds, against the
libraries a user would otherwise pick and the published anchors:

* the pairwise log-sum-exp of a squared-Euclidean cost, value and gradient, n = m = 10^5
  and 10^6, d = 3, and a Gaussian kernel sum at 50,000 x 20,000, d = 3 (a community JAX
  KeOps benchmark: 0.56 ms);
* the Sinkhorn divergence, value and gradient, n = m = 50,000 at d = 3 and d = 64, and
  10^6 at d = 3; 100 iterations at n = 50,000, d = 64 against FlashSinkhorn's A100 figure
  (1.45 s for 100 symmetric iterations);
* attention, value and gradient, T = 16,384 and 65,536, head dims 64 and 128, causal or
  not, bfloat16, 8 query heads with 8 (MHA) or 1 (8:1 grouped-query) K/V heads, against
  ``jax.nn.dot_product_attention`` with ``implementation="cudnn"`` and ``"xla"``;
* the vocabulary-tiled cross-entropy at 32,768 tokens, d = 4,096, V = 128,256, bfloat16,
  against the dense logits (when memwise has it);
* the LSTM of the Flax ``nn.remat`` discussion at T = 10,000 (``nn.scan``, its remat fix,
  Equinox's checkpointed scan and memwise at c = 16) and the adaptive Dormand-Prince
  gradient of the ``while_loop`` benchmark.

Each row has the compiled memory (``memory_analysis()``) and, on a device that reports
them, the device's peak bytes in use after the variant's first run (variants run first in
ascending order of compiled peak, so the process-wide peak is each one's own).

A case runs in a child process under a time limit (a case that runs out or fails is
recorded as such and the next one starts); ``results/accelerator.json`` is rewritten
after every case, so a run cut short keeps what it measured. ``--deadline S`` stops
starting cases after S seconds. ``--cpu`` runs every case at small sizes on the CPU,
writing its JSON to a temporary folder: the check that the script works before a device
is spent on it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import harness
import jax
import jax.numpy as jnp

import memwise as mw

REPEATS = 3  # interleaved rounds per table: device time is scarce


def _grad(fn: Callable, argnums: tuple[int, ...]) -> Callable:
    return jax.value_and_grad(fn, argnums=argnums)


def _table(title: str, variants: list, baseline: str, **kwargs) -> dict:
    kwargs.setdefault("repeats", REPEATS)
    return harness.run_table(title, variants, baseline=baseline, device_peak=True, **kwargs)


# --- pairwise reductions ----------------------------------------------------------------


def _sqdist(a, b):
    return jnp.sum((a - b) ** 2)


def _lse(n: int) -> Callable[[bool], dict]:
    def build(small: bool) -> dict:
        size = 2_000 if small else n
        x = jax.random.normal(jax.random.PRNGKey(0), (size, 3))
        y = jax.random.normal(jax.random.PRNGKey(1), (size, 3))

        def loss(x, y):
            return jnp.sum(mw.pairwise_reduce(lambda a, b: -_sqdist(a, b), x, y))

        variants = [
            harness.Variant("memwise: forward", loss, (x, y)),
            harness.Variant("memwise: value_and_grad", _grad(loss, (0, 1)), (x, y)),
        ]
        title = f"log-sum-exp of -|x - y|^2, n=m={size:,}, d=3, float32"
        return _table(title, variants, "memwise: forward")

    return build


def _gaussian_sum(small: bool) -> dict:
    n, m = (2_000, 800) if small else (50_000, 20_000)
    x = jax.random.normal(jax.random.PRNGKey(0), (n, 3))
    y = jax.random.normal(jax.random.PRNGKey(1), (m, 3))
    w = jax.random.normal(jax.random.PRNGKey(2), (m,))

    def kernel_sum(x, y, w):
        return mw.pairwise_reduce(
            lambda a, b: jnp.exp(-_sqdist(a, b)), x, y, weights=w, reduce="sum"
        )

    variants = [harness.Variant("memwise: Gaussian kernel sum (forward)", kernel_sum, (x, y, w))]
    title = f"Gaussian kernel sum, {n:,} x {m:,}, d=3 (KeOps-class anchor: 0.56 ms)"
    return _table(title, variants, variants[0].name)


# --- optimal transport ------------------------------------------------------------------


def _sinkhorn(n: int, d: int) -> Callable[[bool], dict]:
    def build(small: bool) -> dict:
        size = 1_000 if small else n
        x = jax.random.normal(jax.random.PRNGKey(0), (size, d))
        y = jax.random.normal(jax.random.PRNGKey(1), (size, d)) + 1.0
        loss = jax.value_and_grad(lambda x, y: mw.ot.sinkhorn_divergence(x, y), argnums=(0, 1))
        variants = [harness.Variant("memwise sinkhorn_divergence: value_and_grad", loss, (x, y))]
        if d == 64 and n == 50_000:

            def fixed(x, y):  # 100 iterations whatever the marginal error
                result = mw.ot.sinkhorn(x, y, epsilon=0.1, max_iterations=100, threshold=1e-30)
                return result.f, result.g

            variants.append(harness.Variant("memwise sinkhorn: 100 iterations", fixed, (x, y)))
        title = f"Sinkhorn divergence, n=m={size:,}, d={d}, float32 (FlashSinkhorn anchor: 1.45 s)"
        return _table(title, variants, variants[0].name)

    return build


# --- attention --------------------------------------------------------------------------


def _attention(length: int, head_dim: int, causal: bool, kv_heads: int) -> Callable:
    heads = 8

    def build(small: bool) -> dict:
        t = 512 if small else length
        keys = jax.random.split(jax.random.PRNGKey(0), 3)
        q = jax.random.normal(keys[0], (1, t, heads, head_dim), jnp.bfloat16)
        k, v = (jax.random.normal(kk, (1, t, kv_heads, head_dim), jnp.bfloat16) for kk in keys[1:])

        def loss(attend):
            return lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32) ** 2)

        def jax_nn(implementation):
            return loss(
                lambda q, k, v: jax.nn.dot_product_attention(
                    q, k, v, is_causal=causal, implementation=implementation
                )
            )

        if hasattr(mw, "dot_product_attention"):
            memwise = loss(lambda q, k, v: mw.dot_product_attention(q, k, v, is_causal=causal))
        else:  # (B, T, N, H) -> (B, N, T, H), K/V heads repeated for the older API
            group = heads // kv_heads

            def older(q, k, v):
                swap = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731
                k, v = (jnp.repeat(a, group, axis=2) for a in (k, v))
                return swap(mw.attention(swap(q), swap(k), swap(v), causal=causal))

            memwise = loss(older)
        variants = [
            harness.Variant("memwise: value_and_grad", _grad(memwise, (0, 1, 2)), (q, k, v))
        ]
        implementations = ("xla",) if jax.default_backend() == "cpu" else ("cudnn", "xla")
        for implementation in implementations:
            variants.append(
                harness.Variant(
                    f"jax.nn ({implementation}): value_and_grad",
                    _grad(jax_nn(implementation), (0, 1, 2)),
                    (q, k, v),
                )
            )
        kind = "MHA" if kv_heads == heads else f"{heads // kv_heads}:1 GQA"
        title = (
            f"attention, T={t:,}, {heads} heads, head dim {head_dim}, "
            f"{'causal' if causal else 'full'}, {kind}, bfloat16"
        )
        return _table(title, variants, variants[-1].name)

    return build


# --- cross-entropy over a large vocabulary ----------------------------------------------


def _cross_entropy(small: bool) -> dict:
    tokens, d, vocab = (256, 64, 1_000) if small else (32_768, 4_096, 128_256)
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(keys[0], (tokens, d), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (d, vocab), jnp.float32) / d**0.5).astype(jnp.bfloat16)
    labels = jax.random.randint(keys[2], (tokens,), 0, vocab)

    def dense(x, w, labels):
        logits = (x @ w).astype(jnp.float32)
        lse = jax.nn.logsumexp(logits, axis=-1)
        return jnp.mean(lse - jnp.take_along_axis(logits, labels[:, None], -1)[:, 0])

    def tiled(x, w, labels):
        return mw.linear_cross_entropy(x, w, labels)

    variants = [
        harness.Variant("dense logits: value_and_grad", _grad(dense, (0, 1)), (x, w, labels))
    ]
    variants.append(
        harness.Variant("memwise: value_and_grad", _grad(tiled, (0, 1)), (x, w, labels))
    )
    title = f"cross-entropy, {tokens:,} tokens, d={d:,}, V={vocab:,}, bfloat16"
    return _table(title, variants, variants[0].name)


# --- long loops -------------------------------------------------------------------------


def _lstm(small: bool) -> dict:
    import lstm as lstm_benchmark

    from memwise.scenarios import lstm

    size = dict(hidden=128, output_dim=4, seq2seq=True)
    steps = 200 if small else 10_000
    x, y = lstm.data(10, steps, 32, size["output_dim"], True)
    params = lstm.model("scan", **size).init(jax.random.PRNGKey(0), x[:, :2])["params"]
    args = (params, x, y)
    variants = [
        harness.Variant("nn.scan", lstm_benchmark._flax_loss("scan", size), args),
        harness.Variant("nn.scan(nn.remat)", lstm_benchmark._flax_loss("remat", size), args),
        harness.Variant("equinox c=16", lstm_benchmark._equinox_loss(size, 16), args),
        harness.Variant(
            "memwise.flax.scan c=16", lstm_benchmark._flax_loss("memwise", size, 16), args
        ),
    ]
    title = f"LSTM seq2seq gradient, T={steps:,}, batch 10, hidden 128"
    return _table(title, variants, "nn.scan")


def _while_loop(small: bool) -> dict:
    import while_loop

    with jax.enable_x64(True):
        t1, tol = (20.0, 1e-5) if small else (600.0, 1e-10)
        return while_loop._ode_table(t1, tol, quick=small)


# --- the runner -------------------------------------------------------------------------

# In the order they run (the most asked-for first), with each case's time limit in seconds.
CASES: dict[str, tuple[Callable[[bool], dict], int]] = {
    "lse-1e5": (_lse(100_000), 60),
    "gaussian-sum": (_gaussian_sum, 60),
    "attention-16k-h128-causal-mha": (_attention(16_384, 128, True, 8), 90),
    "attention-16k-h128-causal-gqa": (_attention(16_384, 128, True, 1), 90),
    "attention-16k-h64-full-mha": (_attention(16_384, 64, False, 8), 90),
    "sinkhorn-50k-d64": (_sinkhorn(50_000, 64), 120),
    "sinkhorn-50k-d3": (_sinkhorn(50_000, 3), 90),
    "cross-entropy": (_cross_entropy, 120),
    "lstm-10k": (_lstm, 120),
    "lse-1e6": (_lse(1_000_000), 120),
    "attention-64k-h128-causal-mha": (_attention(65_536, 128, True, 8), 150),
    "attention-16k-h64-causal-gqa": (_attention(16_384, 64, True, 1), 90),
    "attention-16k-h128-full-gqa": (_attention(16_384, 128, False, 1), 90),
    "attention-64k-h64-full-gqa": (_attention(65_536, 64, False, 1), 150),
    "while-loop": (_while_loop, 120),
    "sinkhorn-1e6-d3": (_sinkhorn(1_000_000, 3), 240),
}


def _available(name: str) -> str | None:
    if name == "cross-entropy" and not hasattr(mw, "linear_cross_entropy"):
        return "memwise has no linear_cross_entropy in this checkout"
    return None


def _child(name: str, small: bool, out: str) -> None:
    table = CASES[name][0](small)
    table["case"] = name
    with open(out, "w") as f:
        json.dump(table, f, default=str)


def _run_case(name: str, small: bool, limit: float) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "table.json")
        command = [sys.executable, __file__, "--case", name, "--out", out]
        command += ["--cpu"] if small else []
        start = time.perf_counter()
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=limit)
        except subprocess.TimeoutExpired:
            return {"case": name, "failure": f"ran past its {limit:.0f} s limit", "rows": []}
        elapsed = time.perf_counter() - start
        if proc.returncode != 0 or not os.path.exists(out):
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return {"case": name, "failure": " / ".join(tail) or f"exit {proc.returncode}"}
        with open(out) as f:
            table = json.load(f)
        table["case_s"] = elapsed
        return table


def main(
    quick: bool = False, cpu: bool = False, only: list[str] | None = None, deadline: float = 0
) -> None:
    if jax.default_backend() == "cpu" and not cpu:
        print("benchmark 'accelerator': no GPU/TPU found (backend cpu); nothing to do")
        print("(python benchmarks/accelerator.py --cpu checks the script at small sizes)")
        return
    small = cpu or quick
    if small:  # a check of the script, not a result for BENCHMARKS.md
        harness.RESULTS = Path(tempfile.gettempdir()) / "memwise-accelerator-check"
    start = time.perf_counter()
    tables: list[dict] = []
    device = jax.devices()[0].device_kind
    notes = f"On {device}. " + " ".join(__doc__.split("\n\n")[1].split())
    for name in only or list(CASES):
        if deadline and time.perf_counter() - start > deadline:
            tables.append({"case": name, "failure": "not started: the run's deadline passed"})
        elif reason := _available(name):
            tables.append({"case": name, "failure": f"skipped: {reason}"})
        else:
            tables.append(_run_case(name, small, CASES[name][1] * (4 if small else 1)))
        table = tables[-1]
        if table.get("rows"):
            harness.print_table(table)
        else:
            print(f"{name}: {table['failure']}", flush=True)
        harness.save("accelerator", tables, quick=small, notes=notes)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU at small sizes")
    parser.add_argument("--deadline", type=float, default=0, help="start no case after S s")
    parser.add_argument("--only", nargs="+", choices=list(CASES), help="these cases only")
    parser.add_argument("--case", choices=list(CASES), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        _child(args.case, args.cpu or args.quick, args.out)
    else:
        main(quick=args.quick, cpu=args.cpu, only=args.only, deadline=args.deadline)
