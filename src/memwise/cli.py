"""The ``memwise`` command: ``demo``, ``report`` and ``bench``.

``demo`` compiles each scenario's naive and memwise programs, compares their compiled
peaks (XLA ``memory_analysis()``), runs them where they fit and checks they agree.
``report`` prints the memory report of a user's function (``--timeline``: live
memory along its compiled schedule; ``--plot`` and ``--timeline-plot``: either plot, or
both). ``bench`` runs the benchmark scripts of a source checkout and regenerates
BENCHMARKS.md.

Exit status: 0 on success, 1 when a budget cannot be met (or a demo disagrees), 2 for a
usage error (bad arguments or budget, a module or factory that cannot be found, input
that memwise rejects), printed as one line on stderr that names the problem and the fix.
Errors raised inside the user's own code keep their traceback.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["main"]

_PACKAGE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "")


class UsageError(Exception):
    """A bad command line: ``main`` prints it as one line on stderr and exits with 2."""


def _raised_by_memwise(error: BaseException) -> bool:
    """Whether memwise itself raised ``error`` (its input checks), not the user's code."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and os.path.abspath(frames[-1].filename).startswith(_PACKAGE_DIR)


def _check_plot_path(plot: str | None, option: str = "--plot") -> None:
    """Fail before compiling anything when a plot cannot be written (the check every
    ``plot`` method makes, with the option's name)."""
    if plot is None:
        return
    try:
        from memwise._display import check_plot_path

        check_plot_path(plot, option)
    except ImportError as error:
        raise UsageError(f"{option} {error}") from None
    except ValueError as error:
        raise UsageError(str(error)) from None


def _save_plot(save: Callable[[str], None], plot: str) -> None:
    try:
        save(plot)
    except OSError as error:
        raise UsageError(f"cannot write --plot {plot!r} ({error}); pass a writable path") from None


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
        "headline": scenario.headline,
    }


def _headline(row: dict) -> str:
    """The figure a scenario is about: its peak, or (a naive program that fails to load
    because of what it bakes in) its constants."""
    from memwise.measure import format_bytes

    if row.get("headline", "peak") == "constants":
        naive, mine = row["naive_constants"], row["memwise_constants"]
        return f"constants {format_bytes(naive)} -> {format_bytes(mine)}"
    ratio = row["naive_peak"] / max(row["memwise_peak"], 1)
    return f"peak {ratio:.1f}x lower" if ratio >= 1 else f"peak {1 / ratio:.1f}x higher"


def _print_demo_table(rows: Sequence[dict]) -> None:
    from memwise.measure import format_bytes

    header = (
        "scenario",
        "memwise vs naive",
        "naive peak",
        "memwise peak",
        "constants naive/memwise",
        "agree",
        "wall s",
    )
    cells = [
        (
            r["scenario"],
            _headline(r),
            format_bytes(r["naive_peak"]),
            format_bytes(r["memwise_peak"]),
            f"{format_bytes(r['naive_constants'])} / {format_bytes(r['memwise_constants'])}",
            r["agree"],
            f"{r['seconds']:.1f}",
        )
        for r in rows
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
    left = (0, 1, 5)
    line = "  ".join(f"{{:<{w}}}" if i in left else f"{{:>{w}}}" for i, w in enumerate(widths))
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
    fig, ax = plt.subplots(figsize=(8, 1.5 + 0.8 * len(rows)))
    positions = range(len(rows))
    ax.barh(
        [p + 0.2 for p in positions],
        [r["naive_peak"] / 2**20 for r in rows][::-1],
        height=0.4,
        label="naive JAX",
        color="tab:gray",
    )
    ax.barh(
        [p - 0.2 for p in positions],
        [r["memwise_peak"] / 2**20 for r in rows][::-1],
        height=0.4,
        label="memwise",
        color="tab:blue",
    )
    # Each row's label carries its headline: a peak ratio, or the constants that made the
    # naive program fail to load (its bars then show peaks that are alike).
    ax.set_yticks(list(positions), [f"{r['scenario']}\n{_headline(r)}" for r in rows][::-1])
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
        raise UsageError(
            f"unknown scenario(s) {unknown}; choose from {', '.join(scenarios.available())}"
        )
    _check_plot_path(plot)
    print(
        f"memwise demo: {len(chosen)} scenario(s) at size {size!r}; compiled peaks from "
        "XLA memory_analysis() (arrays baked into a program as constants are listed "
        "apart), results checked against the naive program",
        flush=True,
    )
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
        _save_plot(lambda path: _plot_demo(rows, path), plot)
        print(f"\nwrote {plot}")
    return 0 if all(r["agree"] != "NO" for r in rows) else 1


def load_factory(spec: str) -> tuple[Any, tuple, dict]:
    """``MODULE:FACTORY`` (dotted module or a .py path) -> (fn, args, kwargs)."""
    module_name, sep, factory_name = spec.rpartition(":")
    if not sep or not module_name or not factory_name:
        raise UsageError(f"expected MODULE:FACTORY (e.g. my_model:factory), got {spec!r}")
    try:
        if module_name.endswith(".py") or os.sep in module_name:
            path = Path(module_name).resolve()
            if not path.is_file():
                raise UsageError(f"no such file {module_name!r}; pass path/to/file.py:FACTORY")
            loader_spec = importlib.util.spec_from_file_location(path.stem, path)
            if loader_spec is None or loader_spec.loader is None:
                raise UsageError(
                    f"cannot load {module_name!r} as Python code; pass path/to/file.py:FACTORY"
                )
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[path.stem] = module
            loader_spec.loader.exec_module(module)
        else:
            sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        missing = error.name or str(error)
        fix = (
            "run memwise from the folder that holds it, or pass path/to/file.py:FACTORY"
            if module_name.split(".")[0] == missing.split(".")[0]
            else f"{module_name} imports it: install it"
        )
        raise UsageError(
            f"cannot import {module_name!r}: no module named {missing!r}; {fix}"
        ) from None
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise UsageError(f"{module_name} has no function {factory_name!r}")
    required = _required_parameters(factory)
    if required:  # the function to measure named instead of its factory
        example = ", ".join(required) + ("," if len(required) == 1 else "")
        raise UsageError(
            f"{factory_name} takes arguments ({', '.join(required)}), but FACTORY must be a "
            f"zero-argument function returning (fn, args), e.g. "
            f"def factory(): return {factory_name}, ({example})"
        )
    made = factory()
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        got = f"a tuple of {len(made)}" if isinstance(made, tuple) else type(made).__name__
        raise UsageError(
            f"{factory_name}() must return (fn, args) or (fn, args, kwargs), got {got}"
        )
    fn, args = made[0], made[1]
    kwargs = made[2] if len(made) == 3 else {}
    if not isinstance(args, (tuple, list)):
        # An array here would be iterated into one argument per row.
        raise UsageError(
            f"{factory_name}() must return (fn, args) with args a tuple of fn's "
            f"arguments (for one argument: (x,)), got {type(args).__name__}"
        )
    if not isinstance(kwargs, dict):
        raise UsageError(
            f"{factory_name}() must return (fn, args, kwargs) with kwargs a dict, got "
            f"{type(kwargs).__name__}"
        )
    return fn, tuple(args), kwargs


def _required_parameters(factory: Callable) -> list[str]:
    """The parameters ``factory()`` would be missing (none for a callable without a
    Python signature: calling it is the only check)."""
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return []
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [
        p.name
        for p in parameters
        if p.default is inspect.Parameter.empty
        and (p.kind in positional or p.kind is inspect.Parameter.KEYWORD_ONLY)
    ]


def _static_options(args: tuple, kwargs: dict) -> dict:
    """Factory arguments that hold no arrays (Python numbers, strings, functions) are
    static: passed to ``fn`` as they are, as ``jax.jit(static_argnums=...)`` passes them."""
    import jax

    def holds_array(value: Any) -> bool:
        return any(
            hasattr(leaf, "shape") and hasattr(leaf, "dtype")
            for leaf in jax.tree_util.tree_leaves(value)
        )

    return {
        "static_argnums": tuple(i for i, a in enumerate(args) if not holds_array(a)),
        "static_argnames": tuple(k for k, v in kwargs.items() if not holds_array(v)),
    }


def report(
    spec: str,
    grad: bool,
    as_json: bool,
    plot: str | None,
    budget: str | None = None,
    timeline: bool = False,
    timeline_plot: str | None = None,
) -> int:
    from memwise.fit import MemoryBudgetError, fit
    from memwise.measure import memory_report, parse_budget

    timeline_option = "--timeline-plot"
    if timeline and timeline_plot is None and plot is not None:
        # Without --timeline-plot, --timeline makes --plot the timeline's plot (as before
        # --timeline-plot existed); with it, --plot is always the residuals' chart.
        plot, timeline_plot, timeline_option = None, plot, "--plot"
    timeline = timeline or timeline_plot is not None

    budget_bytes = None
    if budget is not None:
        try:
            budget_bytes = parse_budget(budget)
        except ValueError as error:
            raise UsageError(f"--budget: {error}") from None
    _check_plot_path(plot)
    _check_plot_path(timeline_plot, timeline_option)
    if plot and timeline_plot and os.path.abspath(plot) == os.path.abspath(timeline_plot):
        raise UsageError(
            f"--plot and --timeline-plot both name {plot!r}; pass two paths "
            "(one for the residuals, one for the timeline)"
        )
    fn, args, kwargs = load_factory(spec)
    static = _static_options(args, kwargs)
    try:
        if budget_bytes is not None:
            fitted = fit(fn, budget=budget_bytes, grad=grad, **static)
            try:
                result = fitted.report_for(*args, **kwargs)
            except MemoryBudgetError as error:
                print(f"memwise report: {error}", file=sys.stderr)
                return 1
            if not as_json:
                print(fitted.plan_text(*args, **kwargs))
                print()
        else:
            result = memory_report(fn, *args, grad=grad, **static, **kwargs)
    except (TypeError, ValueError) as error:
        if not _raised_by_memwise(error):
            raise  # a bug in the user's code: keep its traceback
        hint = " (drop --grad to measure fn itself)" if grad and "grad=True" in str(error) else ""
        raise UsageError(f"{spec}: {error}{hint}") from None
    live = result.timeline() if timeline else None
    if as_json:
        data = result.to_dict()
        if live is not None:
            data["timeline"] = live.to_dict()
        print(json.dumps(data, indent=2))
    else:
        print(result.to_text())
        if live is not None:
            print()
            print(live.to_text())
    for path, save in ((plot, result.plot), (timeline_plot, live.plot if live else None)):
        if path and save is not None:
            _save_plot(save, path)
            print(f"wrote {path}", file=sys.stderr)
    return 0


def _benchmarks_dir() -> Path:
    candidates = [Path(__file__).resolve().parents[2] / "benchmarks", Path.cwd() / "benchmarks"]
    for candidate in candidates:
        if (candidate / "run.py").exists():
            return candidate
    raise UsageError(
        "it is a development command that runs a source checkout's benchmarks/ folder; "
        "clone the repository and run `python -m benchmarks` (or `memwise bench`) there"
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
    p_demo.add_argument(
        "--size",
        choices=("default", "report", "seed"),
        default="default",
        help="'report' (or its older name 'seed') uses the sizes of the "
        "original user reports (slow)",
    )
    p_demo.add_argument("--plot", metavar="PATH", help="write a bar chart of the table")

    p_report = commands.add_parser("report", help="memory report of MODULE:FACTORY")
    p_report.add_argument(
        "factory",
        metavar="MODULE:FACTORY",
        help="zero-argument function returning (fn, args) or (fn, args, "
        "kwargs); arguments that hold no arrays are static",
    )
    p_report.add_argument("--grad", action="store_true", help="report jax.grad(fn)")
    p_report.add_argument("--json", action="store_true", help="print JSON")
    p_report.add_argument(
        "--plot",
        metavar="PATH",
        help="bar chart of the largest residuals (with --timeline and no --timeline-plot: "
        "the timeline)",
    )
    p_report.add_argument(
        "--timeline",
        action="store_true",
        help="live memory along the compiled schedule: the peak step and the buffers alive there",
    )
    p_report.add_argument(
        "--timeline-plot",
        metavar="PATH",
        help="plot of the timeline (implies --timeline); with --plot, both plots in one call",
    )
    p_report.add_argument(
        "--budget", help="fit fn's 'auto' knobs to this budget (e.g. 2GiB, '2.5 GB', 1e9)"
    )

    p_bench = commands.add_parser(
        "bench",
        help="development: run a source checkout's benchmarks/ and regenerate BENCHMARKS.md",
    )
    p_bench.add_argument("names", nargs="*", help="benchmarks (default: all)")
    p_bench.add_argument("--quick", action="store_true", help="small sizes, one timing round")

    args = parser.parse_args(argv)
    try:
        if args.command == "demo":
            return demo(args.names, args.size, args.plot)
        if args.command == "report":
            return report(
                args.factory,
                args.grad,
                args.json,
                args.plot,
                args.budget,
                args.timeline,
                args.timeline_plot,
            )
        return bench(args.names, args.quick)
    except UsageError as error:
        print(f"memwise {args.command}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
