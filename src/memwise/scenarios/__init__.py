"""Users' memory problems as runnable pairs: the naive JAX program and the memwise one.

Each module here but ``mlp`` (a worked example) answers one public user report, named in
its docstring, and exposes ``SIZES = {"default": {...}, "report": {...}}`` ("report": the
sizes of the original user report) and ``make(**size) -> Scenario``. The two programs of
a scenario take the same arguments and compute the same pytree, so ``memwise demo`` can
compile both, compare their compiled peaks, run both when they fit and check that they
agree.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

__all__ = ["HEADLINES", "NAMES", "Scenario", "available", "load"]

# Demo order: the worked example first, then the user reports.
NAMES = ("mlp", "lstm", "pointcloud", "kip", "linearize", "lmhead")

# What a scenario's memwise program changes (Scenario.headline).
HEADLINES = ("peak", "constants")


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A computation written twice: the way JAX users write it today, and with memwise.

    Attributes:
      name: the scenario's name (its module name).
      description: one line saying what is computed and at which size.
      naive: the plain JAX program, a function of ``*args``.
      memwise: the memwise program, a function of the same ``*args`` giving the same
        pytree (up to ``rtol``/``atol``).
      args: the arguments both programs are compiled and run with.
      rtol, atol: the tolerances of :meth:`agree`.
      headline: what the memwise program changes, the demo table's first figure:
        ``"peak"`` (the compiled peak, naive over memwise) or ``"constants"`` (the bytes
        baked into the program, naive -> memwise, for a scenario whose naive program
        fails because of them, not because of its peak).
    """

    name: str
    description: str
    naive: Callable[..., Any]
    memwise: Callable[..., Any]
    args: tuple
    rtol: float = 1e-4
    atol: float = 1e-5
    headline: str = "peak"

    def __post_init__(self) -> None:
        if self.headline not in HEADLINES:
            raise ValueError(f"headline must be one of {HEADLINES}, got {self.headline!r}")

    def agree(self, naive_out: Any, memwise_out: Any) -> bool:
        """Whether both programs' outputs have one structure and are close."""
        import jax
        import numpy as np

        naive_leaves, naive_tree = jax.tree_util.tree_flatten(naive_out)
        memwise_leaves, memwise_tree = jax.tree_util.tree_flatten(memwise_out)
        if naive_tree != memwise_tree:  # type: ignore[operator]  # jaxlib: no PyTreeDef stub
            return False
        return all(
            np.shape(a) == np.shape(b)
            and np.allclose(np.asarray(a), np.asarray(b), rtol=self.rtol, atol=self.atol)
            for a, b in zip(naive_leaves, memwise_leaves)
        )


def available() -> tuple[str, ...]:
    """Names of the scenario modules present in this installation, in demo order."""
    return tuple(n for n in NAMES if importlib.util.find_spec(f"{__name__}.{n}") is not None)


# Older name of the "report" size, still accepted (``memwise demo --size seed``).
_SIZE_ALIASES = {"seed": "report"}


def load(name: str, size: str = "default") -> Scenario:
    """Builds scenario ``name`` at ``size``: "default" (small, quick) or "report" (the
    sizes of the original user report; "seed" is accepted as an alias)."""
    if name not in available():
        raise ValueError(f"unknown scenario {name!r}; choose from {', '.join(available())}")
    module = importlib.import_module(f"{__name__}.{name}")
    size = _SIZE_ALIASES.get(size, size)
    if size not in module.SIZES:
        raise ValueError(f"size must be one of {sorted(module.SIZES)}, got {size!r}")
    return module.make(**module.SIZES[size])
