"""Memory budgets: bytes from ``"8GiB"``, ``"1e9"``, ``1 << 30`` or a fraction of the device.

:func:`parse_budget` is the one reader of a budget (``mw.fit``, ``memwise report
--budget``); a float is a fraction of :func:`device_memory_bytes` (the allocator's
limit, or the host's RAM on CPU, :func:`host_memory_bytes`).
"""

from __future__ import annotations

import math
import os
import re

import jax
import numpy as np

__all__ = ["device_memory_bytes", "host_memory_bytes", "parse_budget"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}

_BUDGET_FORMS = (
    "bytes as an int (1 << 30) or a string ('8GiB', '2.5 GB', '512MB', '1e9', "
    "'1,000,000', '1_000_000'), or a fraction of device memory in (0, 1] such as 0.8"
)

# A number (thousands separated by ',' or '_' allowed, decimals, an exponent), then a unit.
_NUMBER = r"(?:\d{1,3}(?:,\d{3})+|\d+(?:_\d+)*)(?:\.\d*)?|\.\d+"
_BUDGET_RE = re.compile(
    rf"\s*(?P<sign>[+-]?)\s*(?P<number>(?:{_NUMBER})(?:[eE][+-]?\d+)?)"
    r"\s*(?P<unit>[a-zA-Z]*)\s*"
)


def host_memory_bytes() -> int:
    """Physical memory of this machine (8 GiB where the OS does not say).

    Example::

        >>> from memwise.measure import host_memory_bytes
        >>> host_memory_bytes() >= 2**20
        True
    """
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 8 << 30


def device_memory_bytes() -> int:
    """Memory of the default device: the allocator's limit, or the host's RAM on CPU.

    Example::

        >>> from memwise.measure import device_memory_bytes, parse_budget
        >>> # a float budget is a fraction
        >>> parse_budget(0.5) == device_memory_bytes() // 2
        True
    """
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - backends without memory_stats
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return host_memory_bytes()


def parse_budget(budget: int | float | str) -> int:
    """Bytes from ``1 << 30``, ``"8GiB"``, ``"2.5 GB"``, ``"1e9"``, ``"1,000"`` or ``0.8``.

    An int or a string is bytes: a string is a number (thousands separated by ``,`` or
    ``_``, decimals and exponents allowed) with an optional decimal (``MB``) or binary
    (``MiB``) unit. A float is a fraction of :func:`device_memory_bytes` in (0, 1].

    Raises:
      ValueError: for zero, negative, NaN or infinite budgets and unreadable strings; the
        message lists the accepted forms.
      TypeError: for other types (a bool, None, a list).

    Example::

        >>> from memwise.measure import parse_budget
        >>> parse_budget("1.5 KiB"), parse_budget("2MB"), parse_budget(4096)
        (1536, 2000000, 4096)
        >>> parse_budget("1e9"), parse_budget("1,000"), parse_budget("2.5GiB")
        (1000000000, 1000, 2684354560)
    """
    # Concrete types rather than numbers.Integral/Real, which type checkers cannot relate
    # to int and float.
    if isinstance(budget, (bool, np.bool_)) or not isinstance(
        budget, (int, np.integer, float, np.floating, str)
    ):
        raise TypeError(f"budget must be {_BUDGET_FORMS}; got {type(budget).__name__} {budget!r}")
    if isinstance(budget, (int, np.integer)):
        if budget <= 0:
            raise ValueError(f"budget must be positive, got {budget}; pass {_BUDGET_FORMS}")
        return int(budget)
    if isinstance(budget, (float, np.floating)):
        if not 0 < budget <= 1:  # also rejects NaN
            raise ValueError(
                f"a float budget is a fraction of device memory in (0, 1], got {budget!r}; "
                f"for bytes pass an int or a string: {_BUDGET_FORMS}"
            )
        return int(budget * device_memory_bytes())
    match = _BUDGET_RE.fullmatch(budget)
    if match is None or match["unit"].lower() not in _UNITS:
        raise ValueError(f"cannot read budget {budget!r}; write {_BUDGET_FORMS}")
    value = float(match["number"].replace(",", "")) * _UNITS[match["unit"].lower()]
    if match["sign"] == "-" or not math.isfinite(value) or int(value) <= 0:
        raise ValueError(
            f"budget must be a finite size of at least one byte, got {budget!r}; write {_BUDGET_FORMS}"
        )
    return int(value)
