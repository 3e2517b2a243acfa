"""The ``memwise`` command: ``demo``, ``report`` and ``bench``.

``demo`` compiles each scenario's naive and memwise programs, compares their compiled
peaks (XLA ``memory_analysis()``), runs them where they fit and checks they agree.
``report`` prints the memory report of a user's function. ``bench`` runs the benchmark
scripts of a source checkout and regenerates BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["main"]

# Run a program only when its compiled peak leaves room for the rest of the process.
_RUN_FRACTION_OF_RAM = 0.5


def _demo_row(name: str, size: str) -> dict:
    import jax

    from memwise import scenarios
    from memwise.measure import compile_measured, host_memory_bytes

    start = time.perf_counter()
    scenario = scenarios.load(name, size)
    naive_exe, naive_mem = compile_measured(scenario.naive, *scenario.args)
    memwise_exe, memwise_mem = compile_measured(scenario.memwise, *scenario.args)
    room = _RUN_FRACTION_OF_RAM * host_memory_bytes()
    memwise_out = jax.block_until_ready(memwise_exe(*scenario.args))
    if naive_mem.peak_bytes <= room:
        naive_out = jax.block_until_ready(naive_exe(*scenario.args))
        agree = "yes" if scenario.agree(naive_out, memwise_out) else "NO"
    else:
        agree = "naive too large to run"
    return {
        "scenario": name,
        "description": scenario.description,
        "naive_peak": naive_mem.peak_bytes,
        "memwise_peak": memwise_mem.peak_bytes,
        "naive_constants": naive_mem.constant_bytes,
        "memwise_constants": memwise_mem.constant_bytes,
        "agree": agree,
        "seconds": time.perf_counter() - start,
    }


def _print_demo_table(rows: Sequence[dict]) -> None:
    from memwise.measure import format_bytes

    header = ("scenario", "naive peak", "memwise peak", "ratio", "constants naive/memwise",
              "agree", "wall s")
    cells = [
        (
            r["scenario"],
            format_bytes(r["naive_peak"]),
            format_bytes(r["memwise_peak"]),
            f"{r['naive_peak'] / max(r['memwise_peak'], 1):.1f}x",
            f"{format_bytes(r['naive_constants'])} / {format_bytes(r['memwise_constants'])}",
            r["agree"],
            f"{r['seconds']:.1f}",
        )
        for r in rows
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
    line = "  ".join(f"{{:<{w}}}" if i in (0, 5) else f"{{:>{w}}}" for i, w in enumerate(widths))
    print(line.format(*header))
    print(line.format(*("-" * w for w in widths)))
    for c in cells:
        print(line.format(*c))
    print()
    for r in rows:
        print(f"  {r['scenario']}: {r['description']}")


def _plot_demo(rows: Sequence[dict], path: str) -> None:
    from memwise.measure import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 1.5 + 0.6 * len(rows)))
    names = [r["scenario"] for r in rows][::-1]
    positions = range(len(names))
    ax.barh([p + 0.2 for p in positions], [r["naive_peak"] / 2**20 for r in rows][::-1],
            height=0.4, label="naive JAX", color="tab:gray")
    ax.barh([p - 0.2 for p in positions], [r["memwise_peak"] / 2**20 for r in rows][::-1],
            height=0.4, label="memwise", color="tab:blue")
    ax.set_yticks(list(positions), names)
    ax.set_xscale("log")
    ax.set_xlabel("compiled peak memory (MiB, log scale)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def demo(names: Sequence[str], size: str, plot: str | None) -> int:
    from memwise import scenarios

    chosen = list(names) or list(scenarios.available())
    unknown = [n for n in chosen if n not in scenarios.available()]
    if unknown:
        raise SystemExit(
            f"memwise demo: unknown scenario(s) {unknown}; choose from "
            f"{', '.join(scenarios.available())}"
        )
    print(f"memwise demo: {len(chosen)} scenario(s) at size {size!r}; compiled peaks from "
          "XLA memory_analysis() (arrays baked into a program as constants are listed "
          "apart), results checked against the naive program", flush=True)
    rows = []
    for i, name in enumerate(chosen, 1):
        print(f"[{i}/{len(chosen)}] {name} ...", flush=True)
        try:
            rows.append(_demo_row(name, size))
        except ModuleNotFoundError as error:  # a scenario built on an optional peer
            print(f"  skipped: it needs {error.name!r} (pip install 'memwise[demo]')")
    if not rows:
        raise SystemExit("memwise demo: no scenario could run; pip install 'memwise[demo]'")
    print()
    _print_demo_table(rows)
    if plot:
        _plot_demo(rows, plot)
        print(f"\nwrote {plot}")
    return 0 if all(r["agree"] != "NO" for r in rows) else 1


def load_factory(spec: str) -> tuple[Any, tuple, dict]:
    """``MODULE:FACTORY`` (dotted module or a .py path) -> (fn, args, kwargs)."""
    module_name, sep, factory_name = spec.rpartition(":")
    if not sep or not module_name or not factory_name:
        raise SystemExit(f"memwise report: expected MODULE:FACTORY, got {spec!r}")
    if module_name.endswith(".py") or os.sep in module_name:
        path = Path(module_name).resolve()
        if not path.exists():
            raise SystemExit(f"memwise report: no such file {module_name!r}")
        loader_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[path.stem] = module
        loader_spec.loader.exec_module(module)
    else:
        sys.path.insert(0, os.getcwd())
        module = importlib.import_module(module_name)
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise SystemExit(f"memwise report: {module_name} has no function {factory_name!r}")
    made = factory()
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise SystemExit(
            f"memwise report: {factory_name}() must return (fn, args) or (fn, args, kwargs)"
        )
    fn, args = made[0], tuple(made[1])
    kwargs = dict(made[2]) if len(made) == 3 else {}
    return fn, args, kwargs


def report(spec: str, grad: bool, as_json: bool, plot: str | None,
           budget: str | None = None) -> int:
    from memwise.measure import memory_report

    fn, args, kwargs = load_factory(spec)
    if budget is not None:
        from memwise.fit import MemoryBudgetError, fit

        fitted = fit(fn, budget=budget, grad=grad)
        try:
            result = fitted.report_for(*args, **kwargs)
        except MemoryBudgetError as error:
            print(f"memwise report: {error}", file=sys.stderr)
            return 1
        if not as_json:
            print(fitted.plan_text(*args, **kwargs))
            print()
    else:
        result = memory_report(fn, *args, grad=grad, **kwargs)
    print(result.to_json() if as_json else result.to_text())
    if plot:
        result.plot(plot)
        print(f"wrote {plot}", file=sys.stderr)
    return 0


def _benchmarks_dir() -> Path:
    candidates = [Path(__file__).resolve().parents[2] / "benchmarks", Path.cwd() / "benchmarks"]
    for candidate in candidates:
        if (candidate / "run.py").exists():
            return candidate
    raise SystemExit(
        "memwise bench runs the scripts in a source checkout's benchmarks/ folder; "
        "run it from a clone of the repository (pip install -e .)"
    )


def bench(names: Sequence[str], quick: bool) -> int:
    runner = _benchmarks_dir() / "run.py"
    command = [sys.executable, str(runner), *names] + (["--quick"] if quick else [])
    return subprocess.call(command)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="memwise", description="Reverse-mode differentiation in JAX that fits in memory."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    p_demo = commands.add_parser("demo", help="naive JAX vs memwise on every scenario")
    p_demo.add_argument("names", nargs="*", help="scenarios (default: all)")
    p_demo.add_argument("--size", choices=("default", "report", "seed"), default="default",
                        help="'report' (or its older name 'seed') uses the sizes of the "
                             "original user reports (slow)")
    p_demo.add_argument("--plot", metavar="PATH", help="write a bar chart of the table")

    p_report = commands.add_parser("report", help="memory report of MODULE:FACTORY")
    p_report.add_argument("factory", metavar="MODULE:FACTORY",
                          help="zero-argument function returning (fn, args) or (fn, args, kwargs)")
    p_report.add_argument("--grad", action="store_true", help="report jax.grad(fn)")
    p_report.add_argument("--json", action="store_true", help="print JSON")
    p_report.add_argument("--plot", metavar="PATH", help="bar chart of the largest residuals")
    p_report.add_argument("--budget", help="fit fn's 'auto' knobs to this budget (e.g. 2GiB)")

    p_bench = commands.add_parser("bench", help="run benchmarks/ and regenerate BENCHMARKS.md")
    p_bench.add_argument("names", nargs="*", help="benchmarks (default: all)")
    p_bench.add_argument("--quick", action="store_true", help="small sizes, one timing round")

    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo(args.names, args.size, args.plot)
    if args.command == "report":
        return report(args.factory, args.grad, args.json, args.plot, args.budget)
    return bench(args.names, args.quick)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
