"""Benchmark harness: compiled memory and interleaved wall-time ratios, in one run.

Every benchmark script builds variants of one computation (the anchors users have today
and memwise), and :func:`run_table` measures them together: compiled buffers from
``memwise.measure.compiled_memory`` (deterministic, machine-independent), then the median
wall time over ``repeats`` runs after a warm-up, the variants interleaved round by round so
that drift of a shared machine cancels in the ratios. :func:`save` writes
``results/NAME.json``; ``run.py`` turns all results into BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax

from memwise.measure import compile_measured, format_bytes

RESULTS = Path(
    os.environ.get("MEMWISE_BENCH_RESULTS") or Path(__file__).resolve().parent / "results"
)
# Compiled memory only, no timing: a fast check that a refactor left every figure as it was.
MEMORY_ONLY = bool(os.environ.get("MEMWISE_BENCH_MEMORY_ONLY"))

__all__ = ["Variant", "run_table", "save", "cli", "peak_rss_bytes", "progress"]


@dataclasses.dataclass
class Variant:
    """One way of computing the benchmark's result.

    ``fn`` is jitted by the harness and called with ``args``; ``extra`` holds columns that
    are not memory or time (counted evaluations, iterations, ...). ``run=False`` compiles
    only (for programs that would not fit or take too long to run here).
    """

    name: str
    fn: Callable[..., Any]
    args: tuple
    extra: dict = dataclasses.field(default_factory=dict)
    run: bool = True


def progress(iterable, **kwargs):
    """tqdm progress bar when available, the plain iterable otherwise."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        return iterable
    kwargs.setdefault("leave", False)
    return tqdm(iterable, file=sys.stderr, **kwargs)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process image so far.

    Reads VmHWM where Linux provides it: ru_maxrss starts at the parent's peak (Linux
    carries it across fork and exec), so a fresh child would report its parent's.
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _block(out: Any) -> Any:
    return jax.block_until_ready(out)


def run_table(
    title: str,
    variants: Sequence[Variant],
    *,
    baseline: str,
    repeats: int = 5,
    quick: bool = False,
    time: bool = True,  # noqa: A002 - a column switch, not the module
    statistic: str = "median",
    device_peak: bool = False,
) -> dict:
    """Measures ``variants``: compiled memory of each, interleaved wall times.

    Returns a table dict ``{"title", "baseline", "rows": [...]}``; each row has
    ``variant``, ``temp_bytes``, ``peak_bytes``, ``argument_bytes``, ``output_bytes``,
    ``compile_s``, ``time_s`` (the ``statistic`` of the runs, or None), ``time_ratio``
    (to ``baseline``) and the variant's ``extra`` columns. ``statistic="min"`` is for
    telling apart programs whose times differ by a few percent: other work on the
    machine only adds time, so the fastest run is the least disturbed.

    ``device_peak=True`` adds ``device_peak_bytes`` where the device reports memory
    statistics (GPUs; XLA:CPU does not): the process's peak bytes in use after each
    variant's first run, the variants run first in ascending order of compiled peak so
    that the process-wide peak is each one's own.
    """
    if statistic not in ("median", "min"):
        raise ValueError(f"statistic must be 'median' or 'min', got {statistic!r}")
    names = [v.name for v in variants]
    if baseline not in names:
        raise ValueError(f"baseline {baseline!r} is not one of the variants {names}")
    repeats = 1 if quick else max(repeats, 5)
    rows, compiled = [], {}
    for variant in progress(variants, desc=f"compile {title}"):
        start = _now()
        exe, memory = compile_measured(variant.fn, *variant.args)
        compile_s = _now() - start
        compiled[variant.name] = exe
        rows.append(
            {
                "variant": variant.name,
                "temp_bytes": memory.temp_bytes,
                "peak_bytes": memory.peak_bytes,
                "argument_bytes": memory.argument_bytes,
                "output_bytes": memory.output_bytes,
                "compile_s": compile_s,
                "time_s": None,
                "time_ratio": None,
                **variant.extra,
            }
        )
    timed = [v for v in variants if v.run] if time and not MEMORY_ONLY else []
    samples: dict[str, list[float]] = {v.name: [] for v in timed}
    stats = jax.devices()[0].memory_stats() if device_peak else None
    peaks = {r["variant"]: r["peak_bytes"] for r in rows}
    for variant in sorted(timed, key=lambda v: peaks[v.name]):  # warm-up
        _block(compiled[variant.name](*variant.args))
        if stats is not None:
            peak = jax.devices()[0].memory_stats().get("peak_bytes_in_use")
            next(r for r in rows if r["variant"] == variant.name)["device_peak_bytes"] = peak
    for _ in progress(range(repeats), desc=f"time {title}"):
        for variant in timed:
            start = _now()
            _block(compiled[variant.name](*variant.args))
            samples[variant.name].append(_now() - start)
    summary = min if statistic == "min" else statistics.median
    for row in rows:
        if samples.get(row["variant"]):
            row["time_s"] = summary(samples[row["variant"]])
    base = next(r for r in rows if r["variant"] == baseline)
    for row in rows:
        if row["time_s"] is not None and base["time_s"]:
            row["time_ratio"] = row["time_s"] / base["time_s"]
    return {
        "title": title,
        "baseline": baseline,
        "repeats": repeats,
        "statistic": statistic,
        "rows": rows,
    }


def _now() -> float:
    return time.perf_counter()


def machine() -> dict:
    import numpy

    versions = {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "numpy": numpy.__version__,
    }
    for name in ("jaxlib", "flax", "equinox", "ott"):
        try:
            module = __import__(name)
            versions[name] = getattr(module, "__version__", "?")
        except ImportError:
            pass
    return {
        "platform": platform.platform(),
        "processor": platform.machine(),
        "cpu_count": os.cpu_count(),
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "versions": versions,
    }


def timing_notes(doc: str | None, load_before: float, rounds: int) -> str:
    """A benchmark's notes: its docstring's summary, and how loaded the machine was while
    its interleaved rounds were timed (``load_before``: ``os.getloadavg()[0]`` at the
    start)."""
    summary = (doc or "").split("\n\n")[0]
    return (
        f"{summary}\n\nOther work was running on this {os.cpu_count()}-core machine while "
        f"it was timed ({load_span(load_before)}): each time is the median of "
        f"{rounds} interleaved rounds, and only ratios within one table mean anything."
    )


def load_span(load_before: float) -> str:
    """How loaded the machine was over a run: ``load_before`` (``os.getloadavg()[0]`` at
    its start) and the load average now."""
    return (
        f"load average {load_before:.1f} when the run started, "
        f"{os.getloadavg()[0]:.1f} when it ended"
    )


def save(name: str, tables: Sequence[dict], notes: str = "", quick: bool = False) -> Path:
    """Writes ``results/NAME.json`` with the tables, the machine and library versions."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {
        "name": name,
        "quick": quick,
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "notes": notes,
        "tables": list(tables),
    }
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return path


def print_table(table: dict) -> None:
    print(markdown_table(table))


_SKIP = {
    "variant",
    "temp_bytes",
    "peak_bytes",
    "argument_bytes",
    "output_bytes",
    "compile_s",
    "time_s",
    "time_ratio",
}


def _cell(value: Any, key: str = "") -> str:
    if value is None:
        return "-"
    if key.endswith("_bytes") and isinstance(value, int):
        return format_bytes(value)
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def _ratio(r: float) -> str:
    """A time ratio to 2 decimals, 3 below 0.1 (a sliding window's share of full
    attention reads 0.037x, not 0.04x)."""
    return f"{r:.2f}x" if r >= 0.1 else f"{r:.3f}x"


def markdown_table(table: dict) -> str:
    """One result table as Markdown: memory, time ratio, then the extra columns."""
    if table.get("failure") and not table.get("rows"):
        return f"**{table.get('title') or table.get('case')}**: {table['failure']}"
    if table.get("columns"):  # a table that names its own columns: [key, label] pairs
        lines = [
            f"**{table['title']}**",
            "",
            "| " + " | ".join(label for _, label in table["columns"]) + " |",
            "|" + "---|" * len(table["columns"]),
        ]
        for row in table["rows"]:
            lines.append(
                "| " + " | ".join(_cell(row.get(k), k) for k, _ in table["columns"]) + " |"
            )
        return "\n".join(lines)
    extra_keys: list[str] = []
    for row in table["rows"]:
        extra_keys += [k for k in row if k not in _SKIP and k not in extra_keys]
    header = ["variant", "temp", "peak", "time / " + table["baseline"], "compile s", *extra_keys]
    lines = [
        f"**{table['title']}**",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for row in table["rows"]:
        cells = [
            row["variant"],
            format_bytes(row["temp_bytes"]),
            format_bytes(row["peak_bytes"]),
            "-" if row["time_ratio"] is None else _ratio(row["time_ratio"]),
            f"{row['compile_s']:.1f}",
            *(_cell(row.get(k), k) for k in extra_keys),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [f"\n{failure}" for failure in table.get("failures", [])]
    return "\n".join(lines)


def cli(main: Callable[..., Any]) -> None:
    """Entry point of a benchmark script: ``python benchmarks/NAME.py [--quick]``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="smaller sizes, one timing round")
    main(quick=parser.parse_args().quick)
