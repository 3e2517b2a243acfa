"""Where a program's memory goes, read from the compiler before anything runs.

XLA assigns every buffer of a compiled program ahead of time, so
``jax.jit(f).lower(*args).compile().memory_analysis()`` states exactly how many bytes of
arguments, outputs and temporaries the program will hold, without executing it.
:func:`compiled_memory` is the one place memwise reads those numbers, and this package
adds what the compiler cannot say: which arrays the backward pass of ``jax.grad`` keeps
(:func:`residuals`, from ``jax.ad_checkpoint``'s saved-residual analysis) and the line of
user code that produced each of them (:func:`memory_report`). It also reads budgets
(:func:`parse_budget`: bytes, ``"8GiB"``, ``"1e9"``, or a fraction of
:func:`device_memory_bytes`). A report's :meth:`MemoryReport.timeline` says *when* the
memory is live, step by step along the compiled schedule (:mod:`memwise.timeline`).

One concept per module, every name importable from ``memwise.measure`` as before:

* ``compiled``: :class:`CompiledMemory`, :func:`compiled_memory`,
  :func:`compile_measured` (the one measuring function);
* ``saved``: :class:`Residual`, :func:`residuals` (what the backward pass keeps, by
  source line; traced, never compiled);
* ``budget``: :func:`parse_budget`, :func:`device_memory_bytes`,
  :func:`host_memory_bytes`;
* ``report``: :class:`MemoryReport` (text, dict, bar chart, constants warning,
  timeline) and :func:`memory_report`.

Peak memory is argument + output - alias + temp, or XLA's ``peak_memory_in_bytes`` where
that is larger (``memwise.measure.compiled`` says why both are read).
"""

# The byte formatter and matplotlib access, importable from here as from the single
# module this package was (the CLI and the benchmarks use them).
from memwise._display import _pyplot as _pyplot
from memwise._display import check_plot_path as check_plot_path
from memwise._display import format_bytes as format_bytes
from memwise.measure.budget import device_memory_bytes, host_memory_bytes, parse_budget
from memwise.measure.compiled import CompiledMemory, compile_measured, compiled_memory
from memwise.measure.report import MemoryReport, memory_report
from memwise.measure.saved import Residual, residuals
from memwise.measure.saved import saved_residuals as saved_residuals

__all__ = [
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
]
