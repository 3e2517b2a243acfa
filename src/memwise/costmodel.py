"""Predicted time of a compiled tile body on this machine: a roofline with a cache curve.

The roofline model (Williams, Waterman & Patterson, *Roofline: an insightful visual
performance model for multicore architectures*, CACM 52(4), 2009) bounds a kernel's
time by its arithmetic and its memory traffic: ``time = max(flops / peak_flops,
bytes / bandwidth)``. memwise reads a tile body's ``flops`` and ``bytes accessed`` from
XLA's own ``cost_analysis()`` of the compiled body, and the machine's balance from a
micro-benchmark run once per backend and device kind (:func:`machine`):

* the flop rate of a float32 matrix product;
* the streaming bandwidth as a function of the working set (32 KiB to 128 MiB): the
  cache hierarchy, which is why a cheap, memory-bound pair function runs fastest with a
  cache-sized tile on a CPU;
* the fixed cost of one operation in a loop body (what makes tiny tiles slow: a tile
  pays it for each operation of its compiled body).

A tile's time is ``max(flops / flop_rate, bytes / bandwidth(bytes)) + loop_overhead``,
with the tile's bytes accessed standing for its working set; a tiling's time is that
times the number of tiles. A tiling of one tile has no loop: XLA removes a loop of one
trip and fuses the reduction into the pair function, so its tile never reaches memory
and only its arithmetic counts. It orders candidate tiles, it does not promise seconds:
XLA's counts leave out fusion-internal reuse and multithreading, and the benchmark
(``benchmarks/fit.py``) checks the resulting choices against measured hand-picked tiles.

The balance is cached in the process and, unless ``MEMWISE_CACHE_DIR`` is ``""``, on
disk under ``$MEMWISE_CACHE_DIR`` (default ``$XDG_CACHE_HOME/memwise`` or
``~/.cache/memwise``), one JSON file per backend and device kind.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["Cost", "Machine", "compiled_cost", "machine", "measure_machine", "tile_time"]


@dataclasses.dataclass(frozen=True)
class Machine:
    """A device's measured balance.

    Attributes:
      key: ``backend/device kind`` it was measured on.
      flops_per_s: float32 matrix-product rate.
      bandwidth: ``(working-set bytes, bytes per second)`` pairs, increasing sizes.
      op_overhead_s: fixed time of one operation in a compiled loop body (its launch),
        measured on a loop of small operations; a tile pays it per operation.
    """

    key: str
    flops_per_s: float
    bandwidth: tuple[tuple[int, float], ...]
    op_overhead_s: float

    def bandwidth_at(self, working_set: float) -> float:
        """Streaming bandwidth for this working set (log-linear between measured sizes)."""
        sizes = [math.log(s) for s, _ in self.bandwidth]
        rates = [r for _, r in self.bandwidth]
        return float(np.interp(math.log(max(working_set, 1.0)), sizes, rates))


def _best_time(run: Callable[[], Any], repeats: int) -> float:
    jax.block_until_ready(run())  # compile and warm up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run())
        samples.append(time.perf_counter() - start)
    return min(samples)


def measure_machine(*, repeats: int = 5) -> Machine:
    """Runs the micro-benchmark on the default device (about a second on a CPU).

    Example::

        >>> from memwise import costmodel
        >>> m = costmodel.measure_machine(repeats=1)
        >>> m.flops_per_s > 0 and m.op_overhead_s > 0
        True
    """
    # fit asks for the balance while it traces the user's function: without this, the
    # arrays below would be traced values and nothing would run.
    with jax.ensure_compile_time_eval():
        return _measure(repeats)


def _measure(repeats: int) -> Machine:
    device = jax.devices()[0]
    a = jnp.ones((512, 512), jnp.float32)
    matmul = jax.jit(lambda a: lax.fori_loop(0, 8, lambda _, x: (x @ a) * 1e-3, a))
    flops_per_s = 8 * 2 * 512**3 / _best_time(lambda: matmul(a), repeats)

    bandwidth = []
    for size in (2**15, 2**17, 2**19, 2**21, 2**23, 2**25, 2**27):
        x = jnp.ones(size // 4, jnp.float32)
        # Enough passes over x that the loop, not the dispatch, is timed.
        passes = max(2, min(256, 2**26 // size))
        stream = jax.jit(lambda x, n=passes: lax.fori_loop(0, n, lambda _, v: v * 0.999 + 1e-3, x))
        seconds = _best_time(lambda: stream(x), repeats)
        bandwidth.append((size, 2 * size * passes / seconds))  # read and write

    # A loop body like a tile step (slice by the loop index, reduce, write back), small
    # enough that its arithmetic is negligible: what one more tile costs beyond its work.
    def step(i, carry):
        acc, v = carry
        block = lax.dynamic_slice(v, (i % 64 * 16,), (16,))
        total = jnp.sum(jnp.exp(block))
        return acc + total, lax.dynamic_update_slice(v, block * 0.5 + total * 1e-9, (i % 64 * 16,))

    loop = jax.jit(lambda v: lax.fori_loop(0, 2048, step, (jnp.float32(0), v)))
    body_ops = _operations(jax.jit(step).lower(0, (jnp.float32(0), jnp.ones(1024))).compile())
    overhead = _best_time(lambda: loop(jnp.ones(1024, jnp.float32)), repeats) / 2048 / body_ops
    return Machine(f"{jax.default_backend()}/{device.device_kind}", flops_per_s,
                   tuple(bandwidth), overhead)


_MACHINES: dict[str, Machine] = {}


def _cache_file(key: str) -> str | None:
    folder = os.environ.get("MEMWISE_CACHE_DIR")
    if folder == "":
        return None
    if folder is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        folder = os.path.join(base, "memwise")
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in key)
    return os.path.join(folder, f"machine-{safe}.json")


def machine() -> Machine:
    """The default device's balance: measured once, then cached (in-process and on disk)."""
    device = jax.devices()[0]
    key = f"{jax.default_backend()}/{device.device_kind}"
    if key in _MACHINES:
        return _MACHINES[key]
    path = _cache_file(key)
    found = None
    if path and os.path.exists(path):
        try:
            with open(path) as f:
                data = json.load(f)
            found = Machine(data["key"], float(data["flops_per_s"]),
                            tuple((int(s), float(r)) for s, r in data["bandwidth"]),
                            float(data["op_overhead_s"]))
        except (OSError, ValueError, KeyError, TypeError):
            found = None  # an unreadable cache is measured again and rewritten
    if found is None:
        found = measure_machine()
        if path:
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w") as f:
                    json.dump(dataclasses.asdict(found), f)
            except OSError:
                pass  # a read-only home: the in-process cache still holds it
    _MACHINES[key] = found
    return found


def _operations(compiled: Any) -> int:
    """Instructions of a compiled program's entry computation (its launches per call)."""
    text = compiled.as_text() or ""
    entry = text[text.find("\nENTRY"):] if "\nENTRY" in text else text
    return max(1, sum(1 for line in entry.splitlines() if " = " in line and
                      " parameter(" not in line and " constant(" not in line))


@dataclasses.dataclass(frozen=True)
class Cost:
    """XLA's ``cost_analysis()`` of one compiled tile body, and its operation count."""

    flops: float
    bytes_accessed: float
    operations: int


def compiled_cost(fn: Callable, *args: Any) -> Cost:
    """XLA's cost of ``jax.jit(fn)`` compiled for ``args`` (flops, bytes, operations).

    ``args`` may be ``jax.ShapeDtypeStruct``s: nothing runs. XLA counts a loop's body
    once, so ``fn`` should be one tile's work.
    """
    compiled = jax.jit(fn).lower(*args).compile()
    analysis = compiled.cost_analysis()
    if isinstance(analysis, Sequence):  # older jaxlib: one dict per computation
        analysis = analysis[0] if analysis else {}
    analysis = analysis or {}
    return Cost(float(analysis.get("flops", 0.0)), float(analysis.get("bytes accessed", 0.0)),
                _operations(compiled))


def tile_time(cost: Cost, tiles: int, machine: Machine) -> float:
    """Predicted seconds of ``tiles`` tiles of this cost (see the module docstring).

    Example::

        >>> m = Machine("cpu/test", 1e11, ((2**15, 1e11), (2**27, 1e10)), 1e-7)
        >>> round(tile_time(Cost(1e6, 4e6, 10), 10, m) * 1e3, 3)  # memory-bound
        0.843
        >>> round(tile_time(Cost(1e9, 1e3, 10), 1, m) * 1e3, 3)   # one tile: arithmetic
        10.0
    """
    compute = cost.flops / machine.flops_per_s
    if tiles == 1:
        return compute
    memory = cost.bytes_accessed / machine.bandwidth_at(cost.bytes_accessed)
    return tiles * (max(compute, memory) + cost.operations * machine.op_overhead_s)
