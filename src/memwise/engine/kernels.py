"""The seam for fused kernels: where a backend's own implementation (a Pallas kernel on
GPU or TPU) may replace the engine's plain-JAX tile loops.

The plain-JAX loops evaluate any ``tile_fn``; a fused kernel computes one known tile
function (scaled dot-product scores, say) with its reduction in one program, its own
block sizes and its own backward. A caller that knows its tile function is such a
pattern says so with a :class:`Pattern` (a name and hashable static options); the
engine then asks :func:`find` for a kernel registered for that pattern, the reduction
kind and the platform the computation is traced for, and calls it instead of the
loops. With no kernel registered (the default everywhere; the only path on CPU), or
when every registered kernel declines the call, the plain-JAX loops run: they are the
reference each kernel is tested against (``tests/test_engine.py`` shows the check).

A kernel receives the call's :class:`KernelCall` (pattern, reduction, resolved tiling,
batch, the operands' tree structures) and the operands as the engine's leaves, and
returns what :func:`~memwise.engine.tiled_reduce` returns; it owns its derivative (a
Pallas kernel's ``custom_vjp``). Pallas's ``ops/gpu/attention.py`` is the model:
explicit forward and backward block sizes, a reference implementation beside it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any

import jax

__all__ = ["Kernel", "KernelCall", "Pattern", "find", "register", "registered", "unregister"]


@dataclasses.dataclass(frozen=True)
class Pattern:
    """What a tile function computes, for a kernel to recognise: ``name`` (e.g.
    ``"dot_product_attention"``) and its static ``options`` (sorted ``(key, value)``
    pairs: causal, soft-cap, which masks are present)."""

    name: str
    options: tuple[tuple[str, Hashable], ...] = ()

    def option(self, key: str, default: Any = None) -> Any:
        return dict(self.options).get(key, default)


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """The static parts of one engine call a kernel may read to accept or run it."""

    pattern: Pattern
    reduce: str
    tiles: Any  # memwise.tiling.Tiling
    batch: tuple[int, ...]
    trees: tuple  # treedefs of (rows, cols, pairs, consts)
    ring: Any  # memwise.engine.Ring or None
    platform: str


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A fused implementation of one pattern's reduction on some platforms.

    ``accepts(call) -> bool`` declines what the kernel does not support (a tiling it
    has no block size for, an option it lacks); ``apply(call, rows, cols, pairs,
    consts)`` returns the engine's result for the leaves given.
    """

    name: str
    pattern: str
    reduce: str
    platforms: tuple[str, ...]
    apply: Callable[..., Any]
    accepts: Callable[[KernelCall], bool] = lambda call: True


_REGISTRY: list[Kernel] = []


def register(kernel: Kernel) -> Kernel:
    """Add ``kernel`` (tried before the ones registered earlier); returns it.

    Example::

        >>> k = register(Kernel("demo", "never_used", "sum", ("cpu",), apply=print))
        >>> k in registered()
        True
        >>> unregister(k)
    """
    if not isinstance(kernel, Kernel):
        raise TypeError(f"kernel must be a memwise.engine.kernels.Kernel, got {kernel!r}")
    _REGISTRY.insert(0, kernel)
    return kernel


def unregister(kernel: Kernel) -> None:
    """Remove ``kernel`` (no error when it is not registered)."""
    if kernel in _REGISTRY:
        _REGISTRY.remove(kernel)


def registered() -> tuple[Kernel, ...]:
    """The registered kernels, in the order they are tried."""
    return tuple(_REGISTRY)


def platform() -> str:
    """The platform the computation being traced will run on (JAX's default backend)."""
    return jax.default_backend()


def find(call: KernelCall) -> Kernel | None:
    """The first registered kernel for ``call``'s pattern, reduction and platform that
    accepts it, or ``None`` (then the plain-JAX loops run)."""
    for kernel in _REGISTRY:
        if (
            kernel.pattern == call.pattern.name
            and kernel.reduce == call.reduce
            and call.platform in kernel.platforms
            and kernel.accepts(call)
        ):
            return kernel
    return None
