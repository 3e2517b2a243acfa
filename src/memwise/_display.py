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
    """Raises ``ValueError`` naming ``arg`` when a plot cannot be written to ``path``.

    Checked before any work: ``path`` must not be a folder, its folder must exist and be
    writable, and matplotlib must know its format (a path without an extension is
    written in matplotlib's default format, PNG). The CLI's ``--plot`` and every
    ``plot`` method share this check, with one wording.

    Example::

        >>> check_plot_path("no/such/folder/peak.png")
        Traceback (most recent call last):
        ...
        ValueError: cannot write path 'no/such/folder/peak.png': folder ... does not exist ...
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"{arg} must be a file path (a str or os.PathLike, e.g. 'peak.png'), got "
            f"{type(path).__name__} {path!r}"
        )
    text = os.fspath(path)
    if os.path.isdir(text):
        raise ValueError(f"cannot write {arg} {text!r}: it is a folder; pass a file path")
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ValueError(
            f"cannot write {arg} {text!r}: folder {folder!r} does not exist or is not "
            "writable; pass a path in a writable folder"
        )
    _pyplot()
    from matplotlib.backend_bases import FigureCanvasBase

    extension = os.path.splitext(text)[1].lower().lstrip(".")
    supported = sorted(FigureCanvasBase.get_supported_filetypes())
    if extension and extension not in supported:
        raise ValueError(
            f"cannot write {arg} {text!r}: matplotlib has no .{extension} format; "
            f"end the file name with one of {', '.join('.' + e for e in supported)}"
        )
