"""Benchmark ``sharding``: per-device memory and collectives on D = 1, 2, 4, 8 devices.

The point-cloud gradients (log-sum-exp, Sinkhorn divergence) at n = m = 200,000 and
attention at L = 65,536 (and ``dot_product_attention`` with 8:1 grouped K/V and segment
ids, where ``ring=None``'s choice stands: a ring from 8 devices), each with its gradient,
compiled on D virtual CPU devices (``--xla_force_host_platform_device_count``, one
process per D) with both operands
split over the devices and no ``mesh=`` argument: the sharding of the inputs decides,
and the second operand travels on a ring (``ring=True``). Memory is the compiled per-device
``memory_analysis()``; the collectives are counted in the compiled HLO. At D = 4 the
ring and the replicated second operand (``ring=False``) are timed at run-able sizes.
Where the program takes ``ring=``, the second operand held whole (``ring=False``) is
compiled beside the ring at every D, with what ``ring=None`` picks there.

The same D = 4 programs are also compiled as 4 processes of one device each, joined by
``jax.distributed`` on 127.0.0.1 (``python -m memwise.launch``, as a cluster of 4 hosts
would run them): per-device memory and collectives beside the one-process figures.

Targets: per-device arguments + temp at D = 8 within 1.3 x (1/8) of D = 1's in ring
mode; no all-gather of either operand in any ring-mode program.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import harness

DEVICES = (1, 2, 4, 8)
N_POINTS = 200_000
LENGTH, DIM = 65_536, 64
HEADS = 8  # query heads of the grouped-query program (one K/V head)
COLLECTIVES = ("all-gather", "collective-permute", "all-reduce", "all-to-all")
PROCESSES = 4  # the D = 4 programs again, as this many processes of one device each


def _child(n_devices: int, quick: bool) -> None:
    """Runs with ``n_devices`` CPU devices in all (in this process, or in every process
    of a ``memwise.launch`` run, where process 0 prints); prints the rows as JSON."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import memwise as mw
    from memwise import knobs, ot
    from memwise.measure import compile_measured

    mesh = jax.make_mesh((n_devices,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    scale = 8 if quick else 1

    def placed(shape, spec, dtype=jnp.float32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    def lse(x, y, **kw):
        return jnp.sum(
            mw.pairwise_reduce(lambda a, b: -jnp.sum((a - b) ** 2), x, y, reduce="logsumexp", **kw)
        )

    def divergence(x, y):
        return ot.sinkhorn_divergence(x, y, epsilon=0.1, max_iterations=100)

    def attention(q, k, v, **kw):
        return jnp.sum(mw.attention(q, k, v, causal=True, **kw) ** 2)

    def grouped(q, k, v, segments):  # jax.nn's layout, ring=None's choice
        out = mw.dot_product_attention(q, k, v, is_causal=True, q_segment_ids=segments)
        return jnp.sum(out**2)

    n = N_POINTS // scale
    length = LENGTH // scale
    points = placed((n, 2), P("d"))
    qkv = placed((1, length, DIM), P(None, "d"))
    # program: (function, arguments, argnums, whether it takes ring=)
    programs = {
        f"pairwise logsumexp, n = m = {n:,}": (lse, (points, points), (0, 1), True),
        f"Sinkhorn divergence, n = m = {n:,}": (divergence, (points, points), (0, 1), False),
        f"causal attention, L = {length:,}, d = {DIM}": (
            attention,
            (qkv, qkv, qkv),
            (0, 1, 2),
            True,
        ),
        f"8:1 grouped-query causal attention with segment ids, L = {length:,}, N = "
        f"{HEADS}, H = {DIM}": (
            grouped,
            (
                placed((1, length, HEADS, DIM), P(None, "d")),
                placed((1, length, 1, DIM), P(None, "d")),
                placed((1, length, 1, DIM), P(None, "d")),
                placed((1, length), P(None, "d"), jnp.int32),
            ),
            (0, 1, 2),
            False,
        ),
    }
    rows = []
    for name, (fn, args, argnums, takes_ring) in programs.items():
        # ring mode, and the second operand held whole (ring=False); the default
        # (ring=None) is the cost model's choice between them, read off the knob it sets
        # (one device: the one program; Sinkhorn's passes always ring)
        strategies: dict = {"ring": {}}
        if takes_ring and n_devices > 1:
            strategies = {"ring": dict(ring=True), "whole": dict(ring=False)}
        with knobs.recording() as found:
            jax.eval_shape(fn, *args)
        chosen = [k.default for k in found if k.kind == "ring"]
        for strategy, kw in strategies.items():
            start = harness._now()
            program = functools.partial(fn, **kw)
            exe, memory = compile_measured(program, *args, grad=True, argnums=argnums)
            hlo = exe.as_text()
            rows.append(
                {
                    "program": name,
                    "strategy": strategy,
                    "default": ("ring" if chosen[0] else "whole") if chosen else None,
                    "devices": n_devices,
                    "argument_bytes": memory.argument_bytes,
                    "temp_bytes": memory.temp_bytes,
                    "peak_bytes": memory.peak_bytes,
                    "output_bytes": memory.output_bytes,
                    "compile_s": harness._now() - start,
                    **{c: hlo.count(f" {c}(") + hlo.count(f" {c}-start(") for c in COLLECTIVES},
                }
            )
    timing = None
    if n_devices == 4 and jax.process_count() == 1:
        # Ring vs a replicated second operand, on sizes that run in seconds here.
        small = placed((20_000 // scale, 2), P("d"))
        small_qkv = placed((1, 8192 // scale, DIM), P(None, "d"))
        concrete = lambda s: jax.device_put(  # noqa: E731
            jax.random.normal(jax.random.PRNGKey(0), s.shape, s.dtype), s.sharding
        )
        xs, qs = concrete(small), concrete(small_qkv)
        grad = lambda f, k: jax.value_and_grad(f, k)  # noqa: E731
        timing = [
            harness.run_table(
                f"pairwise logsumexp value_and_grad, n = m = {small.shape[0]:,}, D = 4",
                [
                    harness.Variant(
                        "ring", grad(lambda x, y: lse(x, y, ring=True), (0, 1)), (xs, xs)
                    ),
                    harness.Variant(
                        "replicated y (ring=False)",
                        grad(lambda x, y: lse(x, y, ring=False), (0, 1)),
                        (xs, xs),
                    ),
                ],
                baseline="ring",
                quick=quick,
            ),
            harness.run_table(
                f"causal attention value_and_grad, L = {small_qkv.shape[1]:,}, D = 4",
                [
                    harness.Variant(
                        "ring",
                        grad(lambda q, k, v: attention(q, k, v, ring=True), (0, 1, 2)),
                        (qs, qs, qs),
                    ),
                    harness.Variant(
                        "replicated k, v (ring=False)",
                        grad(lambda q, k, v: attention(q, k, v, ring=False), (0, 1, 2)),
                        (qs, qs, qs),
                    ),
                ],
                baseline="ring",
                quick=quick,
            ),
        ]
    if jax.process_index() == 0:
        print(json.dumps({"rows": rows, "timing": timing}), flush=True)


def _run_child(n_devices: int, quick: bool, processes: int = 1) -> dict:
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={n_devices}",
    )
    child = [__file__, "--child", str(n_devices)] + (["--quick"] if quick else [])
    if processes > 1:
        per_process = str(n_devices // processes)
        launch = ["-m", "memwise.launch", "-n", str(processes), "--cpu-devices", per_process]
        child = [*launch, "--timeout", "1800", *child]
    proc = subprocess.run(
        [sys.executable, *child], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _row(variant: str, r: dict, **extra) -> dict:
    """A compiled-only table row from a child's row: its memory, then ``extra``."""
    memory = ("temp_bytes", "peak_bytes", "argument_bytes", "output_bytes", "compile_s")
    return {
        "variant": variant,
        **{k: r[k] for k in memory},
        "time_s": None,
        "time_ratio": None,
        **extra,
    }


def _processes_table(one: dict, many: dict) -> dict:
    """The D = 4 ring programs as one process of 4 devices and as PROCESSES processes."""
    rows = [
        _row(f"{r['program']}: {label}", r, **{c: r[c] for c in COLLECTIVES})
        for label, result in (("1 process x 4 devices", one), (f"{PROCESSES} processes x 1", many))
        for r in result["rows"]
        if r["strategy"] == "ring"
    ]
    return {
        "title": "D = 4, value_and_grad, per device, ring mode: one process or four (jax.distributed)",
        "baseline": rows[0]["variant"],
        "repeats": 0,
        "rows": rows,
    }


def main(quick: bool = False) -> None:
    results = {d: _run_child(d, quick) for d in harness.progress(DEVICES, desc="devices")}
    processes = _run_child(4, quick, processes=PROCESSES)
    tables = []
    ring_rows = {d: [r for r in results[d]["rows"] if r["strategy"] == "ring"] for d in DEVICES}
    # the programs taking ring=, compiled with the second operand whole beside the ring
    takes_ring = [r["program"] for r in results[2]["rows"] if r["strategy"] == "whole"]
    for program in [r["program"] for r in ring_rows[1]]:
        # a program without ring= whose split records the knob: ring=None decides
        chosen = program not in takes_ring and any(
            r["default"] for r in results[8]["rows"] if r["program"] == program
        )
        one = next(r for r in ring_rows[1] if r["program"] == program)
        base = one["argument_bytes"] + one["temp_bytes"]
        rows = []
        for d in DEVICES:
            r = next(r for r in ring_rows[d] if r["program"] == program)
            per_device = r["argument_bytes"] + r["temp_bytes"]
            rows.append(
                _row(
                    f"D = {d}",
                    r,
                    **{
                        "arguments + temp": harness.format_bytes(per_device),
                        "x D / D=1's": round(per_device * d / base, 2),
                        **({"ring=None picks": r["default"] or "-"} if chosen else {}),
                        **{c: r[c] for c in COLLECTIVES},
                    },
                )
            )
        table = {
            "title": f"{program}, value_and_grad, per device, "
            + ("ring=None's choice" if chosen else "ring mode"),
            "baseline": "D = 1",
            "repeats": 0,
            "rows": rows,
        }
        harness.print_table(table)
        tables.append(table)
    # The chooser: what ring=None picks at each D, beside both strategies' memory.
    for program in takes_ring:
        rows = []
        for d in DEVICES[1:]:
            by = {r["strategy"]: r for r in results[d]["rows"] if r["program"] == program}
            ring, whole = by["ring"], by["whole"]
            rows.append(
                _row(
                    f"D = {d}",
                    whole,
                    **{
                        "ring=None picks": ring["default"],
                        "ring: peak": harness.format_bytes(ring["peak_bytes"]),
                        "whole: peak": harness.format_bytes(whole["peak_bytes"]),
                        "whole / ring": round(whole["peak_bytes"] / ring["peak_bytes"], 2),
                        "whole: all-gathers": whole["all-gather"],
                    },
                )
            )
        table = {
            "title": f"{program}, value_and_grad, per device: ring or whole (ring=None's choice)",
            "baseline": "D = 2",
            "repeats": 0,
            "rows": rows,
        }
        harness.print_table(table)
        tables.append(table)
    table = _processes_table(results[4], processes)
    harness.print_table(table)
    tables.append(table)
    for table in results[4]["timing"]:
        harness.print_table(table)
        tables.append(table)
    harness.save(
        "sharding",
        tables,
        notes=(
            "Virtual CPU devices of one 2-core machine: memory and collective counts are "
            "what XLA compiles for D devices; the D = 4 times share 2 cores, so they "
            "compare transfer patterns, not scaling. 'x D / D=1's' is D times the "
            "per-device arguments + temp over D = 1's (1.0 = perfect 1/D scaling). "
            "Tiles are the default chunk_size='auto': about 8 MiB of intermediates per "
            "tile (by its estimate) on one device; on D devices held to the bytes of a "
            "device's share of the operands, not below 1 MiB."
        ),
        quick=quick,
    )


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--child":
        _child(int(sys.argv[2]), "--quick" in sys.argv)
    else:
        harness.cli(main)
