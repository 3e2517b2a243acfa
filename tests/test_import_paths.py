"""Every public import path of a module that became a package keeps working."""

import importlib

import pytest

import memwise as mw

# (module, names importable from it): memwise.ot, memwise.fit, memwise.measure,
# memwise.timeline and memwise.engine were single modules.
PATHS = {
    "memwise.engine": [
        "REDUCTIONS",
        "Reduction",
        "Ring",
        "accumulation_dtype",
        "promote",
        "sum_dtype",
        "tiled_reduce",
    ],
    "memwise.ot": [
        "GromovWassersteinResult",
        "PNormP",
        "SinkhornResult",
        "TransportPlan",
        "sinkhorn",
        "sinkhorn_divergence",
        "gromov_wasserstein",
        "LowRankSinkhornResult",
        "low_rank_sinkhorn",
        "DEFAULT_EPSILON_SCALE",
        "CostFn",
        "ChunkSize",
    ],
    "memwise.fit": [
        "Fitted",
        "MemoryBudgetError",
        "Plan",
        "PlanEntry",
        "POLICIES",
        "Trial",
        "fit",
        "region",
    ],
    "memwise.measure": [
        "CompiledMemory",
        "MemoryReport",
        "Residual",
        "compile_measured",
        "compiled_memory",
        "device_memory_bytes",
        "host_memory_bytes",
        "memory_report",
        "parse_budget",
        "residuals",
        "saved_residuals",
        "format_bytes",
        "check_plot_path",
        "_pyplot",  # the CLI and the benchmarks plot through it
    ],
    "memwise.timeline": [
        "Buffer",
        "Loop",
        "Timeline",
        "argument_source",
        "of_lowered",
        "parse_dump",
        "parse_live_range",
        "parse_buffer_assignment",
        "parse_hlo",
    ],
}


@pytest.mark.parametrize("module, names", sorted(PATHS.items()))
def test_public_names_import_from_their_old_paths(module, names):
    loaded = importlib.import_module(module)
    for name in names:
        assert getattr(loaded, name) is not None, f"{module}.{name}"
    for name in loaded.__all__:
        assert name in names, f"{module}.{name} is public but not listed here"
    namespace: dict = {}
    exec(f"from {module} import {', '.join(names)}", namespace)  # the user's spelling


def test_top_level_names_are_the_packages_objects():
    fit_module = importlib.import_module("memwise.fit")
    assert mw.fit is fit_module.fit and mw.region is fit_module.region
    assert mw.MemoryBudgetError is fit_module.MemoryBudgetError
    assert mw.ot.sinkhorn is importlib.import_module("memwise.ot").sinkhorn
    # raised to users under its public name
    assert fit_module.MemoryBudgetError.__module__ == "memwise.fit"
    measure = importlib.import_module("memwise.measure")
    assert mw.memory_report is measure.memory_report
    assert mw.MemoryReport is measure.MemoryReport and mw.Residual is measure.Residual
    # a report is a CompiledMemory, as when both lived in one module
    assert issubclass(measure.MemoryReport, measure.CompiledMemory)
