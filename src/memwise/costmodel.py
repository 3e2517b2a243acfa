"""Predicted time of a compiled tile body on this machine: a roofline with a cache curve.

The roofline model (Williams, Waterman & Patterson, *Roofline: an insightful visual
performance model for multicore architectures*, CACM 52(4), 2009) bounds a kernel's
time by its arithmetic and its memory traffic: ``time = max(flops / peak_flops,
bytes / bandwidth)``. memwise reads a tile body's ``flops`` and ``bytes accessed`` from
XLA's own ``cost_analysis()`` of the compiled body, and the machine's balance from a
micro-benchmark run once per backend and device kind (:func:`machine`):

* the flop rate of a float32 matrix product;
* the bandwidth of a tile's access pattern (a row max, a shifted sum of exponentials
  and an update over a 2-D block) as a function of the block's size (32 KiB to
  128 MiB): the cache hierarchy, which is why a cheap, memory-bound pair function runs
  fastest with a cache-sized tile on a CPU;
* the fixed cost of one operation in a loop body (what makes tiny tiles slow: a tile
  pays it for each operation of its compiled body).

A tile's time is ``max(flops / flop_rate, bytes / bandwidth(working set))`` plus the
fixed cost of its operations, where the working set is the compiled body's buffers
(XLA's ``memory_analysis()``: arguments, outputs, temporaries); a tiling's time is that
times the number of tiles. A tiling of one tile has no loop: XLA removes a loop of one
trip and fuses the reduction into the pair function, so its tile never reaches memory
and only its arithmetic counts. It orders candidate tiles, it does not promise seconds:
XLA's counts leave out fusion-internal reuse and multithreading, and the benchmark
(``benchmarks/fit.py``) checks the resulting choices against measured hand-picked tiles.

:func:`tile_cost` gives a candidate tile's cost for ``chunk_size="auto"``
(:mod:`memwise.tiling`): the user's function over a tile, compiled at two reference
sizes, read off the line through them.

The balance is cached in the process and, unless ``MEMWISE_CACHE_DIR`` is ``""``, on
disk under ``$MEMWISE_CACHE_DIR`` (default ``$XDG_CACHE_HOME/memwise`` or
``~/.cache/memwise``), one JSON file per backend and device kind.
"""

from __future__ import annotations

import dataclasses
import functools
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
        """Streaming bandwidth for this working set (log-linear between measured sizes).

        A larger working set never streams faster than a smaller one (it fits in no
        faster cache), so each size gets the best rate measured at it or any larger size:
        a dip measured while other work ran does not make a mid-size tile look slow.
        """
        sizes = [math.log(s) for s, _ in self.bandwidth]
        rates = list(np.maximum.accumulate([r for _, r in self.bandwidth][::-1])[::-1])
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
        # A tile's access pattern, not a plain stream: the max over each row, then the
        # sum of exponentials shifted by it, then an update (three passes over the block),
        # as the engine's log-sum-exp reads its tile of scores.
        block = jnp.ones((size // 4 // 256, 256), jnp.float32)
        passes = max(2, min(256, 2**26 // size))

        def reduce_rows(_, v):
            top = jnp.max(v, axis=1, keepdims=True)
            return v * 0.999 + jnp.sum(jnp.exp(v - top), axis=1, keepdims=True) * 1e-6

        run = jax.jit(functools.partial(lax.fori_loop, 0, passes, reduce_rows))
        seconds = _best_time(functools.partial(run, block), repeats)
        bandwidth.append((size, 3 * size * passes / seconds))

    # A loop body like a tile step (slice a block by the loop index, a small product, a
    # row max and shifted sum, write back), small enough that its arithmetic is
    # negligible: the fixed cost per operation that one more tile pays.
    weights = jnp.ones((8, 8), jnp.float32)

    def step(i, carry):
        acc, v = carry
        block = lax.dynamic_slice(v, (i % 64 * 8, 0), (8, 8)) @ weights
        top = jnp.max(block, axis=1, keepdims=True)
        total = jnp.sum(jnp.exp(block - top))
        return acc + total, lax.dynamic_update_slice(v, block * 1e-3, (i % 64 * 8, 0))

    data = (jnp.float32(0), jnp.ones((512, 8), jnp.float32))
    loop = jax.jit(lambda carry: lax.fori_loop(0, 2048, step, carry))
    body_ops = _operations(jax.jit(step).lower(0, data).compile())
    overhead = _best_time(lambda: loop(data), repeats) / 2048 / body_ops
    return Machine(
        f"{jax.default_backend()}/{device.device_kind}", flops_per_s, tuple(bandwidth), overhead
    )


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


def machine(*, refresh: bool = False) -> Machine:
    """The default device's balance: measured once, then cached (in-process and on disk).

    A balance measured while other work loaded the machine stays in the cache: on a
    shared 2-core CPU it halved every rate and moved the cache curve's knee. Call
    ``machine(refresh=True)`` on a quiet machine to measure it again and rewrite the
    cache.

    Example::

        >>> from memwise import costmodel
        >>> costmodel.machine().key == costmodel.machine().key
        True
    """
    if not isinstance(refresh, bool):
        raise TypeError(f"refresh must be True or False, got {refresh!r}")
    device = jax.devices()[0]
    key = f"{jax.default_backend()}/{device.device_kind}"
    if key in _MACHINES and not refresh:
        return _MACHINES[key]
    path = _cache_file(key)
    found = None
    if path and os.path.exists(path) and not refresh:
        try:
            with open(path) as f:
                data = json.load(f)
            found = Machine(
                data["key"],
                float(data["flops_per_s"]),
                tuple((int(s), float(r)) for s, r in data["bandwidth"]),
                float(data["op_overhead_s"]),
            )
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
    entry = text[text.find("\nENTRY") :] if "\nENTRY" in text else text
    return max(
        1,
        sum(
            1
            for line in entry.splitlines()
            if " = " in line and " parameter(" not in line and " constant(" not in line
        ),
    )


@dataclasses.dataclass(frozen=True)
class Cost:
    """One compiled tile body: XLA's ``cost_analysis()`` and ``memory_analysis()``.

    ``working_set`` is the body's arguments + outputs + temporaries as XLA assigns them:
    the bytes its traffic cycles through, which decide the cache level it streams from.
    """

    flops: float
    bytes_accessed: float
    operations: int
    working_set: float


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
    memory = compiled.memory_analysis()
    working_set = (
        (memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes)
        if memory is not None
        else 0
    )
    bytes_accessed = float(analysis.get("bytes accessed", 0.0))
    return Cost(
        float(analysis.get("flops", 0.0)),
        bytes_accessed,
        _operations(compiled),
        float(working_set or bytes_accessed),
    )


def tile_time(cost: Cost, tiles: int, machine: Machine) -> float:
    """Predicted seconds of ``tiles`` tiles of this cost (see the module docstring).

    Example::

        >>> m = Machine("cpu/test", 1e11, ((2**15, 1e11), (2**27, 1e10)), 1e-7)
        >>> # memory-bound
        >>> round(tile_time(Cost(1e6, 4e6, 10, 4e6), 10, m) * 1e3, 3)
        0.843
        >>> # one tile: arithmetic
        >>> round(tile_time(Cost(1e9, 1e3, 10, 1e3), 1, m) * 1e3, 3)
        10.0
    """
    compute = cost.flops / machine.flops_per_s
    if tiles == 1:
        return compute
    memory = cost.bytes_accessed / machine.bandwidth_at(cost.working_set)
    return tiles * (max(compute, memory) + cost.operations * machine.op_overhead_s)


# Below: the cost of one tile body of a user's function (memwise.tiling's "auto" reads
# it), compiled once per function, shapes and tile.
_TILE_COSTS: dict[tuple, Cost | None] = {}


def tile_body(fn: Callable, n_cols: int | None) -> Callable:
    """One tile's work: ``fn`` over every pair (or item), reduced as the engine reduces.

    The max-shifted sum of exponentials over the columns makes XLA hold the tile of
    scores between two reductions, as the engine's online log-sum-exp does.
    """

    def scores(rows, cols, consts):
        if n_cols is None:
            out = jax.vmap(lambda a: fn(a, *consts))(rows)
        else:
            out = jax.vmap(jax.vmap(lambda a, b: fn(a, b, *consts), (None, 0)), (0, None))(
                rows, cols
            )
        leaves = [jnp.real(leaf).astype(jnp.float32) for leaf in jax.tree.leaves(out)]
        return sum(
            leaf.reshape(leaf.shape[: 1 if n_cols is None else 2] + (-1,)).sum(-1)
            for leaf in leaves
        )

    def body(rows, cols, consts):
        s = scores(rows, cols, consts)
        if n_cols is None:
            return jnp.sum(s)
        top = lax.stop_gradient(jnp.max(s, axis=1, keepdims=True))
        return jnp.sum(jnp.log(jnp.sum(jnp.exp(s - top), axis=1)) + top[:, 0])

    return body


def batched(tree: Any, size: int) -> Any:
    """Abstract ``tree`` with a leading axis of ``size`` items on every leaf."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct((size,) + tuple(a.shape), a.dtype), tree)


def tile_cost(profile: Any, shape: tuple[int, ...], tile: tuple[int, ...]) -> Cost | None:
    """XLA's cost of one tile body of ``tile``, from the body compiled at two sizes.

    ``profile`` is a :class:`memwise.tiling.ItemBytes`: the function, its example item
    (or pair) and constants, and a key for the compilations' cache.

    A tile body's flops and bytes are an affine function of its pairs (items): each pair
    is the same work, plus a fixed part (the reductions' outputs). So the body is
    compiled at a small and a larger reference tile (clipped to the problem) and every
    candidate is read off the line through them: two compilations per function and
    shapes instead of one per candidate.
    """
    references = [
        tuple(min(n, r) for n, r in zip(shape, (64,) * len(shape))),
        tuple(min(n, r) for n, r in zip(shape, (256,) * len(shape))),
    ]
    low, high = (_compiled_tile(profile, *ref, *((None,) * (2 - len(ref)))) for ref in references)
    if low is None or high is None:
        return None
    p_low, p_high = (math.prod(r) for r in references)
    pairs = math.prod(tile)
    if p_high == p_low:
        return high
    slope = (pairs - p_low) / (p_high - p_low)

    def line(field: str) -> float:
        a, b = getattr(low, field), getattr(high, field)
        return max(0.0, a + slope * (b - a))

    return Cost(line("flops"), line("bytes_accessed"), high.operations, line("working_set"))


def _compiled_tile(profile: Any, rows: int, cols: int | None) -> Cost | None:
    key = (profile.key, rows, cols)
    if profile.fn is None:
        return None
    if key not in _TILE_COSTS:
        consts = profile.examples[1 if cols is None else 2 :]
        try:
            first = batched(profile.examples[0], rows)
            second = None if cols is None else batched(profile.examples[1], cols)
            _TILE_COSTS[key] = compiled_cost(tile_body(profile.fn, cols), first, second, consts)
        except Exception:  # noqa: BLE001 - e.g. fn closes over traced values: no model
            _TILE_COSTS[key] = None
    return _TILE_COSTS[key]
