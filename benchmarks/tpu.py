"""Benchmark ``tpu``: attention on one TPU chip, memwise against the kernels a TPU user
already has, forward and value_and_grad.

Variants, all bfloat16, batch 1, 8 query heads, ``(B, T, N, H)`` inputs as
``jax.nn.dot_product_attention`` callers pass them:

* ``memwise``: ``mw.dot_product_attention`` with its default dispatch (on a TPU: splash
  attention's kernels behind memwise's backend seam, moved to heads-first and back);
* ``memwise xla``: the same call with ``implementation="xla"`` (memwise's XLA tiles);
* ``splash <blocks>``: JAX's Pallas splash attention called directly on heads-first
  inputs, at each block configuration of a small sweep (separate dQ and dK/dV backward
  kernels, or the fused one where its float32 dQ per K/V block fits); the best is
  reported as ``splash best``;
* ``flash``: JAX's Pallas flash attention (heads-first, K/V repeated for grouped-query);
* ``jax.nn xla``: ``jax.nn.dot_product_attention(implementation="xla")``, where it fits.

Per variant: the compiled temporaries (``memory_analysis()``), the median time of
``--repeats`` runs after a warm-up, and TFLOP/s (4 B N T S H, halved when causal; the
gradient counts 3.5 times the forward: two matmuls forward, five backward). Results go to
``results/tpu.json`` after every case, so a run cut short keeps what it measured.
``--cpu`` runs a small case in Pallas's interpret mode: the check that the script works
before device time is spent on it.

``--suite cross_entropy``: the vocabulary cross-entropy instead (mean loss of
``x @ w`` with integer labels, bfloat16, value_and_grad in ``x`` and ``w``): ``dense``
(the logits ``x @ w`` and a float32 log-sum-exp), ``memwise xla``
(``mw.linear_cross_entropy(implementation="xla")``) and ``memwise pallas`` (its fused
kernels) at 8,192 and 32,768 tokens x 4,096 x 128,256 and 8,192 x 2,048 x 256,000
(Gemma-size). TFLOP/s count the dense program's products, ``2 n d V`` forward and three
times that with gradients (the fused kernel does four).

``--suite loops``: checkpointed loops (the seed report's Flax LSTM written in plain JAX:
batch 10, hidden 128, input 32, float32, mean squared error of every step's output,
value_and_grad in the parameters) at 10,000 and 100,000 steps: ``lax.scan``,
``lax.scan(jax.checkpoint(step))`` (the baseline), ``mw.scan`` at 16 and 100
checkpoints, ``schedule="nested"`` with and without ``offload="host"`` and
``mw.while_loop`` at 16 and with ``schedule="nested"`` (with and without host offload)
on the same body; then an adaptive Dormand-Prince solve (the loop of unknown length of
``benchmarks/while_loop.py``, float32) through ``mw.while_loop`` (online, and nested
under Diffrax's default bound) against the same steps in a checkpointed ``lax.scan`` whose length is
the trip count, known in advance. Beside the compiled temporaries (device and host) each
row gives the device's peak bytes in use while it ran (``memory_stats()``; the variants
run in increasing order of compiled temporaries, and a peak below an earlier variant's
cannot be read: shown as an upper bound).

``--suite pairwise``: the squared Euclidean soft c-transform (one pass of
``mw.ot.sinkhorn``: ``-eps log sum_j exp(-|x_i - y_j|^2 / eps)``, float32) at 20,000 x
20,000 and 10^6 x 10^6 points in 3 dimensions, forward and value_and_grad, and 100
Sinkhorn iterations at 20,000 and 50,000 points in 64 dimensions (epsilon 0.1): dense
JAX where the matrix fits (a ``fori_loop`` over the stored cost for Sinkhorn), memwise's
XLA tiles, its held matrix (``chunk_size=None``) and its fused kernel; pairs per second
and the chip's floors (the matrix unit's and the vector unit's); a sweep of the kernel's
blocks and its error against float64 at each matmul precision; a pair function of the
user's (the L1 cost's soft c-transform through ``mw.pairwise_reduce``, 20,000 points, d
= 3) and 100 Sinkhorn iterations of the Euclidean cost (20,000 points, d = 3), both
through the pair function's kernel. ``--cases`` picks the cases whose titles hold one
of its comma-separated words.

Usage: ``python benchmarks/tpu.py [--suite attention|cross_entropy|loops|pairwise] [--cases 4k,16k,64k]
[--full] [--variants memwise] [--cpu]`` (``python -m benchmarks tpu`` on a TPU host;
elsewhere it does nothing).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import memwise as mw

RESULTS = Path(__file__).with_name("results") / "tpu.json"


def _splash_fn(t, heads, kv_heads, causal, blocks, fused, interpret):
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    fq, fkv, bq, bkv = blocks
    sizes = sa.BlockSizes(
        block_q=fq,
        block_kv=fkv,
        block_kv_compute=fkv,
        block_q_dkv=bq,
        block_kv_dkv=bkv,
        block_kv_dkv_compute=bkv,
        block_q_dq=None if fused else bq,
        block_kv_dq=None if fused else bkv,
        use_fused_bwd_kernel=fused,
    )
    one = sa.CausalMask((t, t)) if causal else sa.FullMask((t, t))
    kernel = sa.make_splash_mha_single_device(
        sa.MultiHeadMask([one] * heads), block_sizes=sizes, interpret=interpret
    )
    return jax.vmap(kernel)


def _variants(t, heads, kv_heads, hd, causal, interpret, full):
    scale = hd**-0.5
    rep = heads // kv_heads
    out = {}
    out["memwise"] = (lambda q, k, v: mw.dot_product_attention(q, k, v, is_causal=causal), False)
    if not interpret:
        out["memwise xla"] = (
            lambda q, k, v: mw.dot_product_attention(
                q, k, v, is_causal=causal, implementation="xla"
            ),
            False,
        )
    sweep = [
        ((512, 1024, 1024, 1024), False),
        ((1024, 1024, 1024, 1024), False),
        ((512, 512, 512, 512), False),
    ]
    if t <= 16_384:  # the fused backward's float32 dQ per K/V block: 17 GB at 64k
        sweep += [((512, 1024, 512, 1024), True), ((512, 512, 512, 512), True)]
    if interpret:
        sweep = [((128, 128, 128, 128), False)]
    for blocks, fused in sweep:
        blocks = tuple(min(b, t) for b in blocks)
        kernel = _splash_fn(t, heads, kv_heads, causal, blocks, fused, interpret)
        name = f"splash {'fused' if fused else 'separate'} {'x'.join(map(str, blocks))}"
        # heads-first inputs: splash as a user calls it directly (no transposes timed)
        out[name] = (
            functools.partial(
                lambda kernel, q, k, v: kernel(q * jnp.asarray(scale, q.dtype), k, v), kernel
            ),
            True,
        )
    if not interpret:
        from jax.experimental.pallas.ops.tpu import flash_attention as fa

        b = min(512, t)
        sizes = fa.BlockSizes(
            block_q=b,
            block_k_major=b,
            block_k=b,
            block_b=1,
            block_q_major_dkv=b,
            block_k_major_dkv=b,
            block_k_dkv=b,
            block_q_dkv=b,
            block_k_major_dq=b,
            block_k_dq=b,
            block_q_dq=b,
        )

        def flash(q, k, v):  # heads first; K/V repeated for grouped-query (its own cost)
            k, v = (jnp.repeat(a, rep, axis=1) for a in (k, v))
            return fa.flash_attention(q, k, v, causal=causal, sm_scale=scale, block_sizes=sizes)

        out["flash"] = (flash, True)
        if t <= 16_384:
            out["jax.nn xla"] = (
                lambda q, k, v: jax.nn.dot_product_attention(
                    q, k, v, is_causal=causal, implementation="xla"
                ),
                False,
            )
    return out


def _time(fn, args, repeats):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _measure(f, args, work, repeats) -> dict:
    """Compiled temporaries, median time and TFLOP/s of ``f(*args)`` doing ``work``
    flops, or the error of a variant that does not fit."""
    try:
        compiled = jax.jit(f).lower(*args).compile()
        temp_mib = compiled.memory_analysis().temp_size_in_bytes / 2**20
        seconds = _time(compiled, args, repeats)
    except Exception as error:  # noqa: BLE001 - a variant that does not fit
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"}
    return {"temp_mib": temp_mib, "ms": 1e3 * seconds, "tflops": work / seconds / 1e12}


def _cells(row: dict, key: str, r: dict, ratio: float | None, digits: int) -> None:
    """One measured row's cells of a table column group (``fwd`` or ``vjp``)."""
    row[key] = f"{r['ms']:.{digits}f}"
    row[key + "_x"] = "-" if ratio is None else f"{ratio:.2f}x"
    row[key + "_tf"] = f"{r['tflops']:.0f}"
    row[key + "_temp"] = f"{r['temp_mib']:.1f} MiB"


def run_case(t, heads, kv_heads, hd, causal, *, interpret, repeats, full, only=()):
    key = jax.random.key(0)
    kq, kk, kv = jax.random.split(key, 3)
    dtype = jnp.bfloat16
    q = jax.random.normal(kq, (1, t, heads, hd), dtype)
    k = jax.random.normal(kk, (1, t, kv_heads, hd), dtype)
    v = jax.random.normal(kv, (1, t, kv_heads, hd), dtype)
    flops = 4 * heads * t * t * hd * (0.5 if causal else 1.0)
    rows = []
    for name, (fn, heads_first) in _variants(
        t, heads, kv_heads, hd, causal, interpret, full
    ).items():
        if only and not name.startswith(tuple(only)):
            continue
        args = tuple(a.swapaxes(1, 2) for a in (q, k, v)) if heads_first else (q, k, v)
        loss = lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v).astype(jnp.float32) ** 2)
        for mode, f in (("forward", fn), ("value_and_grad", jax.value_and_grad(loss, (0, 1, 2)))):
            work = flops * (3.5 if mode == "value_and_grad" else 1.0)
            row = {"variant": name, "mode": mode, **_measure(f, args, work, repeats)}
            rows.append(row)
            print(
                json.dumps(
                    {
                        "T": t,
                        "heads": heads,
                        "kv_heads": kv_heads,
                        "hd": hd,
                        "causal": causal,
                        **row,
                    }
                ),
                flush=True,
            )
    return rows


def _dense_cross_entropy(x, w, labels):
    logits = (x @ w).astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    return jnp.mean(lse - jnp.take_along_axis(logits, labels[:, None], axis=1)[:, 0])


def run_cross_entropy(n, d, vocab, *, interpret, repeats, only=()):
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (n, d), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (d, vocab)) / d**0.5).astype(jnp.bfloat16)
    labels = jax.random.randint(keys[2], (n,), 0, vocab)
    variants = {
        "dense": lambda x, w: _dense_cross_entropy(x, w, labels),
        "memwise xla": lambda x, w: mw.linear_cross_entropy(x, w, labels, implementation="xla"),
        "memwise pallas": lambda x, w: mw.linear_cross_entropy(
            x, w, labels, implementation="pallas"
        ),
    }
    if interpret:
        del variants["memwise xla"]
    rows = []
    for name, fn in variants.items():
        if only and not name.startswith(tuple(only)):
            continue
        for mode, f in (("forward", fn), ("value_and_grad", jax.value_and_grad(fn, (0, 1)))):
            work = 2 * n * d * vocab * (3 if mode == "value_and_grad" else 1)
            row = {"variant": name, "mode": mode, **_measure(f, (x, w), work, repeats)}
            rows.append(row)
            print(json.dumps({"n": n, "d": d, "V": vocab, **row}), flush=True)
    return rows


CROSS_ENTROPY_NOTES = (
    "One TPU v5e chip, bfloat16 x (tokens, d) and w (d, V), int32 labels, mean loss, "
    "value_and_grad in x and w. dense: the logits x @ w and a float32 log-sum-exp; "
    "memwise xla: mw.linear_cross_entropy's XLA tiles; memwise pallas: its fused Pallas "
    "kernels (one product forward, three backward: the floor is 4/3 of dense's "
    "value_and_grad). TFLOP/s count 2 n d V forward and 3 times that with gradients; the "
    "chip's bfloat16 matmul peak is 197 TFLOP/s on paper. Temporaries exclude the outputs."
)


def _short_error(error: str) -> str:
    """``out of memory (24.71G of 15.75G)`` for XLA's RESOURCE_EXHAUSTED, else its start."""
    import re

    found = re.search(r"temporaries \(([\d.]+G)\) exceeds available HBM \(([\d.]+G)\)", error)
    if found:
        return f"out of memory ({found[1]} of {found[2]})"
    return error[:60]


def cross_entropy_tables(cases: dict) -> list[dict]:
    """One table per case: each variant's forward and value_and_grad against dense."""
    columns = [
        ["variant", "variant"],
        ["fwd", "forward ms"],
        ["fwd_x", "/ dense"],
        ["fwd_tf", "TFLOP/s"],
        ["fwd_temp", "temp"],
        ["vjp", "value_and_grad ms"],
        ["vjp_x", "/ dense"],
        ["vjp_tf", "TFLOP/s"],
        ["vjp_temp", "temp"],
    ]
    out = []
    for case, rows in cases.items():
        dense = {r["mode"]: r for r in rows if r["variant"] == "dense" and "ms" in r}
        merged: dict = {}
        for r in rows:
            row = merged.setdefault(r["variant"], {"variant": r["variant"]})
            key = "fwd" if r["mode"] == "forward" else "vjp"
            if "ms" not in r:
                row[key] = _short_error(r.get("error", "failed"))
                continue
            base = dense.get(r["mode"])
            _cells(row, key, r, r["ms"] / base["ms"] if base else None, 1)
        out.append(
            {
                "title": f"vocabulary cross-entropy on one TPU v5e, {case}",
                "columns": columns,
                "rows": list(merged.values()),
            }
        )
    return out


NOTES = (
    "One TPU v5e chip, bfloat16, batch 1, 8 query heads, head dim 128, causal; loss "
    "sum(out ** 2). memwise: mw.dot_product_attention's default dispatch on (B, T, N, H) "
    "inputs (splash attention's kernels behind memwise's backend seam, q, k, v and the "
    "output moved heads-first and back); memwise xla: its XLA tiles; splash best: the "
    "fastest of a sweep of splash attention's block sizes and backward kernels (fused, or "
    "separate dQ and dK/dV) on heads-first inputs; flash: Pallas flash attention at 512 "
    "blocks (K/V repeated for grouped-query); jax.nn: its XLA implementation (up to 16k). "
    "TFLOP/s count 4 N T^2 H / 2 forward and 3.5 times that for value_and_grad; the "
    "chip's bfloat16 matmul peak is 197 TFLOP/s on paper, about 170 for a plain matmul. Times are medians of 5 runs (3 at "
    "65,536); memory is the compiled temporaries."
)


def tables(cases: dict) -> list[dict]:
    """One BENCHMARKS.md table per case: each variant's forward and value_and_grad."""
    out = []
    columns = [
        ["variant", "variant"],
        ["fwd", "forward ms"],
        ["fwd_x", "/ splash best"],
        ["fwd_tf", "TFLOP/s"],
        ["fwd_temp", "temp"],
        ["vjp", "value_and_grad ms"],
        ["vjp_x", "/ splash best"],
        ["vjp_tf", "TFLOP/s"],
        ["vjp_temp", "temp"],
    ]
    for case, rows in cases.items():
        best = {}
        for mode in ("forward", "value_and_grad"):
            timed = [
                r
                for r in rows
                if r["mode"] == mode and "ms" in r and r["variant"].startswith("splash")
            ]
            best[mode] = min(timed, key=lambda r: r["ms"]) if timed else None
        merged: dict = {}
        for r in rows:
            name = r["variant"]
            if name.startswith("splash"):
                if r is not best[r["mode"]]:
                    continue
                name = f"splash best ({name[len('splash ') :]})"
            key = "fwd" if r["mode"] == "forward" else "vjp"
            row = merged.setdefault(
                r["variant"]
                if not r["variant"].startswith("splash")
                else "splash best " + r["mode"],
                {"variant": name},
            )
            if "ms" not in r:
                row[key] = _short_error(r.get("error", "failed"))
                continue
            ratio = r["ms"] / best[r["mode"]]["ms"] if best[r["mode"]] else None
            _cells(row, key, r, ratio, 2)
        out.append(
            {
                "title": f"attention on one TPU v5e, {case}",
                "columns": columns,
                "rows": list(merged.values()),
            }
        )
    return out


_ATTENTION_CASES = "4k,16k,64k"


def main(argv=None, quick: bool = False) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--suite",
        default="attention",
        choices=("attention", "cross_entropy", "loops", "pairwise", "ot"),
    )
    parser.add_argument(
        "--cases",
        default=_ATTENTION_CASES,
        help="attention: its lengths; other suites: only cases whose titles hold one of these",
    )
    parser.add_argument(
        "--full", action="store_true", help="also full (non-causal) and head dim 64"
    )
    parser.add_argument("--cpu", action="store_true", help="a small case in interpret mode")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--variants", default="", help="only variants whose name starts so")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args([] if argv is None else argv)
    if jax.default_backend() != "tpu" and not args.cpu:
        print("benchmark 'tpu': no TPU found; nothing to do (--cpu checks the script)")
        return 0
    if args.suite == "cross_entropy":
        return _main_cross_entropy(args)
    if args.suite == "loops":
        return _main_loops(args)
    if args.suite == "pairwise":
        return _main_pairwise(args)
    if args.suite == "ot":
        from benchmarks import tpu_ot

        repeats = 1 if args.cpu else args.repeats
        return _main_section(
            args, "ot", tpu_ot.NOTES, tpu_ot.cases(_measure, cpu=args.cpu, repeats=repeats),
            tpu_ot.tables,
        )  # fmt: skip
    if args.cpu:
        cases = [(256, 8, 1, 128, True)]
    else:
        lengths = {"4k": 4096, "16k": 16_384, "64k": 65_536}
        cases = []
        for name in args.cases.split(","):
            for kv_heads in (8, 1):
                for causal in (True, False) if args.full else (True,):
                    for hd in (128, 64) if args.full else (128,):
                        cases.append((lengths[name], 8, kv_heads, hd, causal))
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() and not args.cpu else {}
    results["date"] = time.strftime("%Y-%m-%d")
    results["machine"] = {
        "backend": jax.default_backend(),
        "processor": str(jax.devices()[0].device_kind),
        "cpu_count": os.cpu_count(),
        "versions": {"jax": jax.__version__},
    }
    results["notes"] = NOTES
    results.setdefault("cases", {})
    for t, heads, kv_heads, hd, causal in cases:
        rows = run_case(
            t,
            heads,
            kv_heads,
            hd,
            causal,
            interpret=args.cpu,
            repeats=1 if args.cpu else args.repeats,
            full=args.full,
            only=[v for v in args.variants.split(",") if v],
        )
        name = f"T={t} N={heads} K={kv_heads} H={hd} {'causal' if causal else 'full'}"
        results["cases"][name] = rows
        results["tables"] = tables(results["cases"])
        if not args.cpu:
            out.parent.mkdir(exist_ok=True)
            out.write_text(json.dumps(results, indent=1))
    return 0


def _main_section(args, name: str, notes: str, cases: list, tables) -> int:
    """Runs ``cases`` (``(case name, run)``, ``run(only)`` returning rows) into the
    results' ``name`` section, its tables rewritten after every case."""
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() and not args.cpu else {}
    section = results.setdefault(name, {})
    section["date"] = time.strftime("%Y-%m-%d")
    section["notes"] = notes
    section.setdefault("cases", {})
    only = [v for v in args.variants.split(",") if v]
    picked = [] if args.cases == _ATTENTION_CASES else args.cases.split(",")
    for case, run in cases:
        if picked and not any(p in case for p in picked):
            continue
        # rows of variants this run did not measure (``--variants``) are kept
        fresh = run(only)
        if fresh is None:  # a case with none of the variants asked for
            continue
        measured = {(r["variant"], r.get("mode")) for r in fresh}
        kept = [
            r
            for r in section["cases"].get(case, [])
            if (r["variant"], r.get("mode")) not in measured
        ]
        section["cases"][case] = kept + fresh
        section["tables"] = tables(section["cases"])
        if not args.cpu:
            out.parent.mkdir(exist_ok=True)
            out.write_text(json.dumps(results, indent=1))
    return 0


def _main_cross_entropy(args) -> int:
    if args.cpu:
        sizes = [(256, 128, 1000)]
    else:
        sizes = [(8192, 4096, 128_256), (32_768, 4096, 128_256), (8192, 2048, 256_000)]
    repeats = 1 if args.cpu else args.repeats
    cases = [
        (
            f"{n} tokens x d {d} x V {vocab}",
            lambda only, n=n, d=d, vocab=vocab: run_cross_entropy(
                n, d, vocab, interpret=args.cpu, repeats=repeats, only=only
            ),
        )
        for n, d, vocab in sizes
    ]
    return _main_section(args, "cross_entropy", CROSS_ENTROPY_NOTES, cases, cross_entropy_tables)


def _lstm_step(p, carry, x):
    h, c = carry
    z = x @ p["wi"] + h @ p["wh"] + p["b"]
    i, f, g, o = jnp.split(z, 4, axis=-1)
    c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
    h = jax.nn.sigmoid(o) * jnp.tanh(c)
    return (h, c), h @ p["wo"]


def run_loops(t, *, repeats, only=()):
    batch, hidden, inputs = 10, 128, 32
    k = jax.random.split(jax.random.key(0), 5)
    p = {
        "wi": jax.random.normal(k[0], (inputs, 4 * hidden)) / 8,
        "wh": jax.random.normal(k[1], (hidden, 4 * hidden)) / 16,
        "b": jnp.zeros(4 * hidden),
        "wo": jax.random.normal(k[2], (hidden, 4)) / 16,
    }
    xs = jax.random.normal(k[3], (t, batch, inputs))
    ys = jax.random.normal(k[4], (t, batch, 4))
    carry = (jnp.zeros((batch, hidden)), jnp.zeros((batch, hidden)))

    def scanned(run):
        def loss(p, xs, ys):
            _, out = run(lambda carry, x: _lstm_step(p, carry, x), carry, xs)
            return jnp.mean((out - ys) ** 2)

        return loss

    def while_body(p, xs, ys):
        def body(state):
            i, h, total = state
            h, y = _lstm_step(p, h, xs[i])
            return i + 1, h, total + jnp.sum((y - ys[i]) ** 2)

        return body

    def while_loss(**options):
        def loss(p, xs, ys):
            body = while_body(p, xs, ys)
            _, _, total = mw.while_loop(lambda s: s[0] < t, body, (0, carry, 0.0), **options)
            return total / ys.size

        return loss

    def counter_scan_loss(p, xs, ys):
        # the while loop's body (xs[i], ys[i] read at a carried counter) in mw.scan
        body = while_body(p, xs, ys)
        step = lambda state, _: (body(state), None)  # noqa: E731
        (_, _, total), _ = mw.scan(step, (0, carry, 0.0), length=t, schedule="nested")
        return total / ys.size

    variants = {
        "lax.scan": scanned(jax.lax.scan),
        "lax.scan(jax.checkpoint(step))": scanned(
            lambda f, c, x: jax.lax.scan(jax.checkpoint(f), c, x)
        ),
        "mw.scan, checkpoints=16": scanned(functools.partial(mw.scan, checkpoints=16)),
        "mw.scan, checkpoints=100": scanned(functools.partial(mw.scan, checkpoints=100)),
        "mw.scan, checkpoints=100, schedule='nested'": scanned(
            functools.partial(mw.scan, checkpoints=100, schedule="nested")
        ),
        "mw.scan, schedule='nested'": scanned(functools.partial(mw.scan, schedule="nested")),
        "mw.scan, schedule='nested', offload='host'": scanned(
            functools.partial(mw.scan, schedule="nested", offload="host")
        ),
        "mw.scan, schedule='nested', the while loop's body": counter_scan_loss,
        "mw.while_loop, checkpoints=16": while_loss(checkpoints=16),
        "mw.while_loop, schedule='nested', max_steps=T": while_loss(schedule="nested", max_steps=t),
        "mw.while_loop, schedule='nested', max_steps=T, offload='host'": while_loss(
            schedule="nested", max_steps=t, offload="host"
        ),
    }
    variants = {
        name: loss
        for name, loss in variants.items()
        if not (only and not name.startswith(tuple(only)))
        and not (name == "mw.while_loop, checkpoints=16" and t > 10_000)  # 10x, at 10,000
    }
    rows = _measure_loops(
        {n: jax.value_and_grad(loss) for n, loss in variants.items()}, (p, xs, ys), repeats
    )
    for row in rows:
        print(json.dumps({"T": t, **row}), flush=True)
    return rows


def _measure_loops(variants: dict, args: tuple, repeats: int) -> list[dict]:
    """Each variant compiled, then run in increasing order of compiled temporaries:
    time, device and host temporaries, and the device's peak bytes in use (exact where
    it rose above the earlier variants' peak, else an upper bound)."""
    compiled, rows = {}, {}
    for name, f in variants.items():
        try:
            compiled[name] = jax.jit(f).lower(*args).compile()
        except Exception as error:  # noqa: BLE001 - a variant that does not fit
            rows[name] = {"variant": name, "error": f"{type(error).__name__}: {error}"[:200]}
    device = jax.devices()[0]

    def temp(name):
        return compiled[name].memory_analysis().temp_size_in_bytes

    for name in sorted(compiled, key=temp):
        analysis = compiled[name].memory_analysis()
        before = (device.memory_stats() or {}).get("peak_bytes_in_use", 0)
        try:
            seconds = _time(compiled[name], args, repeats)
        except Exception as error:  # noqa: BLE001 - ran out of memory at run time
            rows[name] = {"variant": name, "error": f"{type(error).__name__}: {error}"[:200]}
            continue
        peak = (device.memory_stats() or {}).get("peak_bytes_in_use", 0)
        rows[name] = {
            "variant": name,
            "ms": 1e3 * seconds,
            "temp_mib": analysis.temp_size_in_bytes / 2**20,
            "host_temp_mib": getattr(analysis, "host_temp_size_in_bytes", 0) / 2**20,
            "peak_mib": peak / 2**20,
            "peak_exact": peak > before,
        }
    return [rows[name] for name in variants if name in rows]


def run_dormand_prince(*, repeats, t1=200.0, tol=1e-6):
    """The adaptive Dormand-Prince gradient of ``benchmarks/while_loop.py`` in float32:
    ``mw.while_loop`` (length unknown to it) against ``lax.scan(jax.checkpoint(step))``
    over the trip count, measured beforehand (what a user does who knows it)."""
    import while_loop as dopri

    theta, y0 = jnp.array([1.1, 0.4, 0.4, 0.1]), jnp.array([10.0, 5.0])
    trips = int(jax.jit(lambda: dopri.solve(jax.lax.while_loop, theta, y0, t1, tol)[3])())

    def scanned(cond, body, init):  # the same body, a fixed number of steps
        step = jax.checkpoint(lambda s, _: (jax.lax.cond(cond(s), body, lambda s: s, s), None))
        return jax.lax.scan(step, init, length=trips)[0]

    loops = {
        "lax.scan(jax.checkpoint(step)), the trip count known": scanned,
        "mw.while_loop, checkpoints=16": functools.partial(mw.while_loop, checkpoints=16),
        # a bound about 1.5x the steps it takes (every one of them runs)
        "mw.while_loop, schedule='nested', max_steps=1024": functools.partial(
            mw.while_loop, schedule="nested", max_steps=1024
        ),
        "mw.while_loop, schedule='nested', max_steps=1024, offload='host'": functools.partial(
            mw.while_loop, schedule="nested", max_steps=1024, offload="host"
        ),
    }
    grads = {
        name: jax.grad(
            lambda theta, y0, loop=loop: jnp.sum(dopri.solve(loop, theta, y0, t1, tol)[1])
        )
        for name, loop in loops.items()
    }
    rows = _measure_loops(grads, (theta, y0), repeats)
    for row in rows:
        print(json.dumps({"case": f"Dormand-Prince, {trips} steps", **row}), flush=True)
    return rows


LOOPS_NOTES = (
    "One TPU v5e chip. The LSTM of the Flax discussion 'How to use nn.remat for LSTM to "
    "save memory?' in plain JAX (batch 10, hidden 128, input 32, float32, mean squared "
    "error of every step's output), value_and_grad in the parameters, compiled; times are "
    "medians of 5 runs, temp the compiled temporaries as XLA:TPU reports them. "
    "mw.while_loop runs the same body reading xs[i], with its online checkpoint "
    "placement. mw.scan's forward is one lax.scan with a branch at the checkpoints; its "
    "backward's replayed steps that store write unconditionally, in a loop of their own. "
    "Temporaries at 10,000 steps are near 0 MiB for mw.scan because XLA:TPU places them "
    "in the chip's on-core memory; at 100,000 steps they are XLA:TPU's copies of the "
    "per-step inputs and outputs (xs in bfloat16 and ys, in layouts padded to 128 lanes: "
    "about 10 KB a step), which lax.scan's gradient holds too, not checkpoints. "
    "schedule='nested' (levels of lax.scan segments under jax.checkpoint: three at "
    "10,000 steps, 66 carries, four at 100,000, 72 carries; its leanest plans need 27 and "
    "33, so no row at 16) differentiates each innermost segment with lax.scan's own "
    "backward: fewer, longer loops. schedule='nested' without checkpoints= is two "
    "levels (segments of about sqrt(T) steps: 100 at 10,000, 317 at 100,000); with "
    "offload='host' the same segments' starting carries live in pinned host memory (the "
    "host temp column) and XLA fetches each back for its segment's backward, overlapped "
    "with compute: 1.03x and 1.01x the on-device time. The device's peak bytes in use "
    "(memory_stats()) counts the arrays the runtime allocates (arguments, outputs: xs "
    "and ys, about 14 and 137 MiB here) and not the program's temporaries, so it does not "
    "show them. Dormand-Prince: the adaptive solve of benchmarks/while_loop.py in float32 "
    "from t = 0 to 200 at tolerance 1e-6, gradient of the final state's sum in the "
    "parameters; mw.while_loop decides its checkpoints online at every "
    "step, which the chip pays for. mw.while_loop(schedule='nested', max_steps=...) runs "
    "all max_steps steps of the bounded loop as mw.scan's nested segments (about "
    "sqrt(max_steps) steps each), every step a select on the loop's predicate: the LSTM "
    "with max_steps = T, the Dormand-Prince solve with a bound of 1,024 steps (it takes "
    "698). The while loops' LSTM body reads xs[i] and ys[i] at a "
    "counter in its carry; 'the while loop's body' runs that body in mw.scan's nested "
    "segments, to separate what the loop costs from what its reads cost."
)


def loops_tables(cases: dict) -> list[dict]:
    columns = [
        ["variant", "variant"],
        ["ms", "value_and_grad ms"],
        ["x", "/ lax.scan(jax.checkpoint(step))"],
        ["temp", "temp"],
        ["host", "host temp"],
        ["peak", "device peak in use"],
    ]
    out = []
    for case, rows in cases.items():
        base = next((r for r in rows if r["variant"].startswith("lax.scan(") and "ms" in r), None)
        table_rows = []
        for r in rows:
            if "ms" not in r:
                table_rows.append({"variant": r["variant"], "ms": _short_error(r["error"])})
                continue
            ratio = "-" if base is None else f"{r['ms'] / base['ms']:.2f}x"
            table_rows.append(
                {
                    "variant": r["variant"],
                    "ms": f"{r['ms']:.1f}",
                    "x": ratio,
                    "temp": f"{r['temp_mib']:.1f} MiB",
                    "host": f"{r.get('host_temp_mib', 0.0):.1f} MiB",
                    "peak": "-"
                    if "peak_mib" not in r
                    else f"{'' if r['peak_exact'] else '<= '}{r['peak_mib']:.1f} MiB",
                }
            )
        title = f"LSTM gradient on one TPU v5e, {case}"
        if case.startswith("Dormand"):
            title = "adaptive Dormand-Prince gradient on one TPU v5e (float32, t1 200, tol 1e-6)"
        out.append(
            {
                "title": title,
                "columns": columns,
                "rows": table_rows,
            }
        )
    return out


def _main_loops(args) -> int:
    repeats = 1 if args.cpu else args.repeats
    cases = [
        (f"T = {t:,}", lambda only, t=t: run_loops(t, repeats=repeats, only=only))
        for t in ([200] if args.cpu else [10_000, 100_000])
    ]
    cases.append(
        (
            "Dormand-Prince",
            lambda only: run_dormand_prince(repeats=repeats, **({"t1": 5.0} if args.cpu else {})),
        )
    )
    return _main_section(args, "loops", LOOPS_NOTES, cases, loops_tables)


# -- pairwise reductions and Sinkhorn --------------------------------------------------

# The chip's floors per pair. Matrix unit: 2 d flops per pair and pass at the bfloat16
# peak (197 TFLOP/s; float32 at "highest" takes six bfloat16 passes). Vector unit: the
# kernel's forward does per pair one add (the column term), one max, one subtract, one
# exponential and one add (the row sum); its backward one add, one subtract, one
# exponential, one multiply, one add (the column sum) and the cast: about 5 and 6
# operations; the v5e's vector unit retires 4 x 1,024 float32 operations a cycle at 1.5
# GHz (about 6.1e12 a second) and its exponential unit 1,024 a cycle (1.5e12 a second).
_MXU = 197e12
_VPU = 4 * 1024 * 1.5e9
_EUP = 1024 * 1.5e9


def _floors(pairs: float, d: int, passes: float, ops: float, highest: bool) -> dict:
    mxu = pairs * passes * 2 * d * (6 if highest else 1) / _MXU
    vpu = pairs * passes * max(ops / _VPU, 1 / _EUP)
    return {"mxu_floor_ms": 1e3 * mxu, "vpu_floor_ms": 1e3 * vpu}


def _softmin(x, y, eps, implementation):
    from memwise.ot import passes

    cost, consts = mw.ot.costs.resolve_cost("sqeuclidean", x, y)
    where = passes.Placed(
        mw.tiling.tiling(x.shape[0], y.shape[0], "auto"), implementation=implementation
    )
    lw = jnp.zeros((y.shape[0],), x.dtype)
    return passes.softmin(cost, consts, x, y, lw, eps, where)


def _dense_softmin(x, y, eps):
    c = jnp.sum(x * x, 1)[:, None] + jnp.sum(y * y, 1)[None] - 2 * x @ y.T
    return -eps * jax.nn.logsumexp(-c / eps, axis=1)


def run_softmin(
    n, d, *, repeats, only=(), dense=True, xla=True, modes=("forward", "value_and_grad")
):
    kx, ky = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (n, d), jnp.float32)
    y = jax.random.normal(ky, (n, d), jnp.float32) + 0.5
    eps = jnp.float32(1.0)
    variants = {}
    if dense:
        variants["dense"] = lambda x, y: _dense_softmin(x, y, eps)
    if xla:
        variants["memwise xla"] = lambda x, y: _softmin(x, y, eps, "xla")
    variants["memwise pallas"] = lambda x, y: _softmin(x, y, eps, "pallas")
    rows = []
    for name, fn in variants.items():
        if only and not name.startswith(tuple(only)):
            continue
        loss = lambda x, y, fn=fn: jnp.sum(fn(x, y))
        for mode in modes:
            f = fn if mode == "forward" else jax.value_and_grad(loss, (0, 1))
            r = _measure(f, (x, y), 0.0, repeats if n < 100_000 else 1)
            r.pop("tflops", None)
            vjp = mode != "forward"
            row = {"variant": name, "mode": mode, **r}
            if "ms" in r:
                row["gpairs_s"] = n * n * (3 if vjp else 1) / (r["ms"] * 1e-3) / 1e9
            row.update(_floors(n * n, d, 3 if vjp else 1, 6 if vjp else 5, False))
            rows.append(row)
            print(json.dumps({"n": n, "d": d, **row}), flush=True)
    return rows


def _laplace_score(eps):
    """A pair function of the user's: the L1 (Laplacian) cost's score, no inner product."""
    return lambda a, b: -jnp.sum(jnp.abs(a - b)) / eps


def run_pair_function(n, d, *, repeats, only=(), sweep=()):
    """``-eps log sum_j exp(-|x_i - y_j|_1 / eps)``: dense, the XLA tiles and the pair
    function's kernel, forward and value_and_grad; ``sweep``: the kernel's blocks."""
    from memwise.engine import tpu_pair_function as tpf

    kx, ky = jax.random.split(jax.random.key(3))
    x = jax.random.normal(kx, (n, d), jnp.float32)
    y = jax.random.normal(ky, (n, d), jnp.float32) + 0.5
    eps = jnp.float32(1.0)

    def dense(x, y):
        c = jnp.sum(jnp.abs(x[:, None, :] - y[None]), axis=-1)
        return -eps * jax.nn.logsumexp(-c / eps, axis=1)

    def tiles(implementation):
        return lambda x, y: (
            -eps
            * mw.pairwise_reduce(
                _laplace_score(eps), x, y, reduce="logsumexp", implementation=implementation
            )
        )

    configs = [("dense", dense, None), ("memwise xla", tiles("xla"), None)]
    configs += [("memwise pallas", tiles("pallas"), None)]
    configs += [(f"memwise pallas {r}x{c}", tiles("pallas"), (r, c)) for r, c in sweep]
    original = tpf.block_sizes
    rows = []
    for name, fn, blocks in configs:
        if only and not name.startswith(tuple(only)):
            continue
        if blocks is not None:
            tpf.block_sizes = lambda *a, b=blocks: tpf.Blocks(*b, *b)
        try:
            for mode in ("forward", "value_and_grad"):
                # a new function for each configuration: jit would reuse another's program
                g = functools.partial(fn)
                f = (
                    g
                    if mode == "forward"
                    else jax.value_and_grad(lambda x, y, g=g: jnp.sum(g(x, y)), (0, 1))
                )
                r = _measure(f, (x, y), 0.0, repeats)
                r.pop("tflops", None)
                vjp = mode != "forward"
                row = {"variant": name, "mode": mode, **r}
                if "ms" in r:
                    row["gpairs_s"] = n * n * (3 if vjp else 1) / (r["ms"] * 1e-3) / 1e9
                # per pair: 2 d + (d - 1) + 5 forward; each backward pass re-forms the
                # pair (about 3 d + 6) and weighs its derivative (about 4 d)
                ops = 7 * d + 6 if vjp else 3 * d + 4
                row.update(_floors(n * n, d, 3 if vjp else 1, ops, False))
                rows.append(row)
                print(json.dumps({"n": n, "d": d, **row}), flush=True)
        finally:
            tpf.block_sizes = original
    return rows


def dense_potentials(c, log_a, log_b, eps, iterations):
    """``iterations`` log-domain Sinkhorn iterations on a held cost matrix ``c``."""

    def step(_, fg):
        f, g = fg
        f = -eps * jax.nn.logsumexp(log_b[None] + (g[None] - c) / eps, axis=1)
        g = -eps * jax.nn.logsumexp(log_a[:, None] + (f[:, None] - c) / eps, axis=0)
        return f, g

    return jax.lax.fori_loop(0, iterations, step, (jnp.zeros_like(log_a), jnp.zeros_like(log_b)))


def _dense_sinkhorn(x, y, eps, iterations, cost="sqeuclidean"):
    c = jnp.sum(x * x, 1)[:, None] + jnp.sum(y * y, 1)[None] - 2 * x @ y.T
    if cost == "euclidean":
        c = jnp.sqrt(jnp.maximum(c, 0.0))
    log_a = jnp.full(x.shape[0], -jnp.log(x.shape[0]), x.dtype)
    log_b = jnp.full(y.shape[0], -jnp.log(y.shape[0]), y.dtype)
    f, g = dense_potentials(c, log_a, log_b, eps, iterations)
    return jnp.sum(jnp.exp(log_a) * f) + jnp.sum(jnp.exp(log_b) * g)


def _memwise_sinkhorn(x, y, eps, iterations, chunk_size, implementation, cost="sqeuclidean"):
    out = mw.ot.sinkhorn(
        x,
        y,
        cost=cost,
        epsilon=eps,
        chunk_size=chunk_size,
        max_iterations=iterations,
        min_iterations=iterations,
        implementation=implementation,
    )
    return out.reg_ot_cost


def run_sinkhorn(
    n, d, *, repeats, only=(), iterations=100, dense=True, xla=True, sweep=(), cost="sqeuclidean"
):
    from memwise.engine import tpu_cross_entropy as tce
    from memwise.engine import tpu_dot_scores as tds

    kx, ky = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (n, d), jnp.float32) / d**0.5
    y = jax.random.normal(ky, (n, d), jnp.float32) / d**0.5 + 0.1
    eps = 0.1
    variants = {}
    solve = functools.partial(_memwise_sinkhorn, cost=cost)
    if dense:
        variants["dense"] = lambda x, y: _dense_sinkhorn(x, y, eps, iterations, cost)
    if xla:
        variants["memwise xla"] = lambda x, y: solve(x, y, eps, iterations, "auto", "xla")
        if dense and cost == "sqeuclidean":
            variants["memwise held"] = lambda x, y: solve(x, y, eps, iterations, None, "xla")
    variants["memwise pallas"] = lambda x, y: solve(x, y, eps, iterations, "auto", "pallas")

    def highest(x, y):
        with jax.default_matmul_precision("highest"):
            return solve(x, y, eps, iterations, "auto", "pallas")

    if cost == "sqeuclidean":  # the other costs' kernel computes in float32 alone
        variants["memwise pallas, highest precision"] = highest
    rows = []
    original = tds.pair_block_sizes
    configs = [(name, None) for name in variants] + [
        (f"memwise pallas {r}x{c}", (r, c)) for r, c in sweep
    ]
    for name, blocks in configs:
        if only and not name.startswith(tuple(only)):
            continue
        # a new function for each configuration: jit would reuse another's program
        fn = functools.partial(variants.get(name, variants["memwise pallas"]))
        if blocks is not None:
            tds.pair_block_sizes = lambda *a, b=blocks: tce.Blocks(*b, *b)
        try:
            r = _measure(fn, (x, y), 0.0, repeats if name == "memwise pallas" else 1)
        finally:
            tds.pair_block_sizes = original
        r.pop("tflops", None)
        row = {"variant": name, "mode": "forward", **r}
        if "ms" in r:
            row["gpairs_s"] = 2 * iterations * n * n / (r["ms"] * 1e-3) / 1e9
        ops = 5 if cost == "sqeuclidean" else 3 * d + 6  # differences, squares, sqrt
        row.update(_floors(n * n, d if cost == "sqeuclidean" else 0, 2 * iterations, ops, False))
        rows.append(row)
        print(json.dumps({"n": n, "d": d, "iterations": iterations, **row}), flush=True)
    return rows


def run_precision(n=4096, d=64):
    """The soft c-transform's largest error against float64 (on the host), over epsilon,
    for each implementation and matmul precision."""
    import numpy as np

    kx, ky = jax.random.split(jax.random.key(2))
    x = jax.random.normal(kx, (n, d), jnp.float32) / d**0.5
    y = jax.random.normal(ky, (n, d), jnp.float32) / d**0.5 + 0.1
    eps = 0.1
    xd, yd = np.asarray(x, np.float64), np.asarray(y, np.float64)
    c = ((xd[:, None, :] - yd[None]) ** 2).sum(-1)
    s = -c / eps
    top = s.max(1, keepdims=True)
    want = -eps * (top[:, 0] + np.log(np.exp(s - top).sum(1)))
    rows = []
    for impl in ("xla", "pallas"):
        for precision in ("default", "highest"):
            with jax.default_matmul_precision(precision):
                got = jax.jit(lambda x, y, impl=impl: _softmin(x, y, jnp.float32(eps), impl))(x, y)
            err = float(np.max(np.abs(np.asarray(got, np.float64) - want))) / eps
            row = {"variant": f"memwise {impl}", "precision": precision, "error_over_eps": err}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


PAIRWISE_NOTES = (
    "One TPU v5e chip, float32 points. softmin: one soft c-transform of the squared "
    "Euclidean cost at epsilon 1 (what each Sinkhorn half-step computes), value_and_grad "
    "in both point clouds; Sinkhorn: exactly 100 iterations (two passes each) of "
    "mw.ot.sinkhorn at epsilon 0.1, reg_ot_cost, points N(0, 1/d). dense: the n x m cost "
    "matrix and jax.nn.logsumexp (a fori_loop over the stored matrix for Sinkhorn); "
    "memwise xla: the XLA tiles; memwise held: chunk_size=None; memwise pallas: the fused "
    "kernel. Pairs per second count every pass (three with gradients). Floors: the "
    "matrix unit's (2 d flops per pair at 197 TFLOP/s) and the vector unit's (about 5 "
    "operations per pair forward, 6 backward, at 6.1e12 a second, or one exponential "
    "per pair at 1.5e12 a second, whichever is slower). Default matmul precision unless "
    "stated. A pair function's softmin: the L1 cost -eps log sum_j exp(-|x_i - y_j|_1 / "
    "eps) at epsilon 1 written as a function of two points for mw.pairwise_reduce (no "
    "inner product in it): dense the n x m matrix by broadcasting; memwise pallas its "
    "pair-function kernel (the function traced into the kernel, evaluated per feature; "
    "rows x columns the blocks of both passes where given); its vector-unit floor counts "
    "3 d + 4 operations a pair forward, 7 d + 6 with gradients. Euclidean Sinkhorn: "
    "cost='euclidean' (sqrt of the squared distance: no matrix-unit form), the pair "
    "function's kernel in memwise pallas."
)


def pairwise_tables(cases: dict) -> list[dict]:
    columns = [
        ["variant", "variant"],
        ["mode", "mode"],
        ["ms", "ms"],
        ["x", "/ dense"],
        ["gp", "G pairs/s"],
        ["floor", "floor ms (MXU / VPU)"],
        ["temp", "temp"],
    ]
    out = []
    for case, rows in cases.items():
        if case.startswith("precision"):
            out.append(
                {
                    "title": f"soft c-transform error on one TPU v5e, {case}",
                    "columns": [
                        ["variant", "variant"],
                        ["precision", "matmul precision"],
                        ["err", "max error / epsilon"],
                    ],
                    "rows": [{**r, "err": f"{r['error_over_eps']:.2e}"} for r in rows],
                }
            )
            continue
        dense = {r["mode"]: r for r in rows if r["variant"] == "dense" and "ms" in r}
        table_rows = []
        for r in rows:
            row = {"variant": r["variant"], "mode": r["mode"]}
            if "ms" not in r:
                row["ms"] = _short_error(r.get("error", "failed"))
                table_rows.append(row)
                continue
            base = dense.get(r["mode"])
            row.update(
                ms=f"{r['ms']:.1f}",
                x="-" if base is None else f"{r['ms'] / base['ms']:.2f}x",
                gp=f"{r.get('gpairs_s', 0):.0f}",
                floor=f"{r['mxu_floor_ms']:.1f} / {r['vpu_floor_ms']:.1f}",
                temp=f"{r['temp_mib']:.1f} MiB",
            )
            table_rows.append(row)
        out.append({"title": f"{case} on one TPU v5e", "columns": columns, "rows": table_rows})
    return out


def _main_pairwise(args) -> int:
    repeats = 1 if args.cpu else args.repeats
    if args.cpu:
        cases = [
            ("softmin, 512 x 512, d = 3", lambda only: run_softmin(512, 3, repeats=1, only=only)),
            (
                "a pair function's softmin (L1 cost), 512 x 512, d = 3",
                lambda only: run_pair_function(512, 3, repeats=1, only=only),
            ),
            (
                "100 Sinkhorn iterations, Euclidean cost, 512 x 512, d = 3",
                lambda only: run_sinkhorn(
                    512, 3, repeats=1, only=only, iterations=3, cost="euclidean"
                ),
            ),
            (
                "100 Sinkhorn iterations, 512 x 512, d = 64",
                lambda only: run_sinkhorn(512, 64, repeats=1, only=only, iterations=3),
            ),
        ]
    else:
        cases = [
            ("precision, 4,096 x 4,096, d = 64", lambda only: None if only else run_precision()),
            (
                "softmin, 20,000 x 20,000, d = 3",
                lambda only: run_softmin(20_000, 3, repeats=repeats, only=only),
            ),
            (
                "100 Sinkhorn iterations, 20,000 x 20,000, d = 64",
                lambda only: run_sinkhorn(20_000, 64, repeats=repeats, only=only),
            ),
            (
                "100 Sinkhorn iterations, 50,000 x 50,000, d = 64",
                lambda only: run_sinkhorn(
                    50_000,
                    64,
                    repeats=3,
                    only=only,
                    dense=False,
                    sweep=((512, 2048), (1000, 1024), (1000, 4096), (2000, 2048)),
                ),
            ),
            (
                "a pair function's softmin (L1 cost), 20,000 x 20,000, d = 3",
                lambda only: run_pair_function(
                    20_000,
                    3,
                    repeats=repeats,
                    only=only,
                    sweep=((256, 1024), (512, 1024), (256, 2048)),
                ),
            ),
            (
                "100 Sinkhorn iterations, Euclidean cost, 20,000 x 20,000, d = 3",
                lambda only: run_sinkhorn(20_000, 3, repeats=repeats, only=only, cost="euclidean"),
            ),
            (
                "softmin, 1,000,000 x 1,000,000, d = 3",
                lambda only: run_softmin(
                    1_000_000,
                    3,
                    repeats=1,
                    only=only,
                    dense=False,
                    xla=False,
                    modes=("forward",),
                ),
            ),
        ]
    return _main_section(args, "pairwise", PAIRWISE_NOTES, cases, pairwise_tables)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
