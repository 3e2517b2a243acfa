"""Byte sizes as text and matplotlib access, shared by every memwise report and plot.

One formatter (``1536 -> '1.5 KiB'``) and one way to reach matplotlib (headless, with an
install hint when it is missing, and a check of the output file's format before any work
is done), used by :mod:`memwise.timeline`, :mod:`memwise.measure`, ``fit`` and the CLI.
"""

from __future__ import annotations

import os

__all__ = ["check_plot_path", "format_bytes"]


def format_bytes(n: int | float) -> str:
    """1536 -> '1.5 KiB'."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:  # pragma: no cover - exercised by monkeypatching
        raise ImportError("plotting needs matplotlib: pip install memwise[plot]") from error
    return plt


def check_plot_path(path: str | os.PathLike, arg: str = "path") -> None:
    """Raises ``ValueError`` naming ``arg`` when matplotlib cannot write ``path``'s format.

    A path without an extension is written in matplotlib's default format (PNG).
    """
    _pyplot()
    from matplotlib.backend_bases import FigureCanvasBase

    extension = os.path.splitext(os.fspath(path))[1].lower().lstrip(".")
    supported = sorted(FigureCanvasBase.get_supported_filetypes())
    if extension and extension not in supported:
        raise ValueError(
            f"cannot write {arg} {os.fspath(path)!r}: matplotlib has no .{extension} format; "
            f"end the file name with one of {', '.join('.' + e for e in supported)}"
        )
