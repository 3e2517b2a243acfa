"""The backend seam: where a fused kernel (Pallas, on the platform it is compiled for)
replaces the engine's XLA tile loops.

The XLA loops evaluate any ``tile_fn``; a fused kernel computes one known tile function
(scaled dot-product scores, say) with its reduction in one program, its own block sizes
and its own backward. A caller whose tile function is such a pattern says so with a
:class:`Pattern` (a name and hashable static options) and an ``implementation``:

* ``"xla"``: the loops, everywhere.
* ``None`` (the default): the first registered kernel that serves the call, on the
  platforms it is compiled for, and the loops on every other platform (a kernel
  registered with ``default=False``, not yet measured on its platform, is left out). The choice is
  made when the program is lowered (``jax.lax.platform_dependent``), not when it is
  traced, so ``jax.jit(f, backend="cpu")`` on a TPU host runs the loops. Where no
  platform the kernel is compiled for exists in this process (a CPU-only machine), the
  kernel is not traced at all: the program is the loops' alone.
* ``"pallas"``: that kernel, and a clear error where none serves the call; on a platform
  it is not compiled for it runs in Pallas's interpret mode, which is how the CPU suite
  checks every kernel's code paths against the loops (``tests/test_kernels.py``).

A :class:`Kernel` says which pattern and reduction it computes, the platforms it is
compiled for, why it declines a call (``declines(call, rows, cols, pairs, consts)``
returns the option or shape it cannot serve, or ``None``), and ``apply(call, rows, cols,
pairs, consts, *, interpret)``, which returns what :func:`~memwise.engine.tiled_reduce`
returns and owns its derivative (a ``custom_vjp`` around the kernel's backward).
Kernels register on import (:mod:`memwise.engine.tpu_attention`).

Pallas's ``ops/gpu/attention.py`` is the model: explicit forward and backward block
sizes, a reference implementation beside it (here: the loops).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

__all__ = [
    "IMPLEMENTATIONS",
    "Kernel",
    "KernelCall",
    "Pattern",
    "check_implementation",
    "dispatch",
    "find",
    "first_order",
    "may_serve",
    "points_on_one_device",
    "register",
    "registered",
    "trace_config",
    "unregister",
]

IMPLEMENTATIONS = (None, "xla", "pallas")


@dataclasses.dataclass(frozen=True)
class Pattern:
    """What a tile function computes, for a kernel to recognise: ``name`` (e.g.
    ``"dot_product_attention"``) and its static ``options`` (hashable ``(key, value)``
    pairs: attention's ``Visibility``, from which a kernel builds its mask; which
    operands are present)."""

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
    ring: Any  # memwise.engine.Ring or None


def _serves_all(call: KernelCall, rows: Any, cols: Any, pairs: Any, consts: Any) -> None:
    return None


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A fused implementation of one pattern's reduction.

    ``platforms``: where it is compiled (elsewhere it runs only in interpret mode, and
    only when asked for by ``implementation="pallas"``). ``declines(call, rows, cols,
    pairs, consts)`` names what it cannot serve (an option, a shape, a dtype) or returns
    ``None``; ``apply(call, rows, cols, pairs, consts, *, interpret)`` returns the
    engine's result for those operands. ``default=False``: served only when asked for
    (``implementation="pallas"``), never chosen by ``None``: a kernel whose speed on
    its platform has not been measured against the loops yet.
    """

    name: str
    pattern: str
    reduce: str
    platforms: tuple[str, ...]
    apply: Callable[..., Any]
    declines: Callable[..., str | None] = _serves_all
    default: bool = True


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


def check_implementation(implementation: Any, name: str = "implementation") -> None:
    """A one-line ``ValueError`` unless ``implementation`` is one of
    :data:`IMPLEMENTATIONS`."""
    if not (
        implementation is None
        or (isinstance(implementation, str) and implementation in IMPLEMENTATIONS)
    ):
        raise ValueError(
            f"{name} must be None (a fused kernel where one is compiled for the "
            f"platform, the XLA loops elsewhere), 'xla' or 'pallas'; got {implementation!r}"
        )


@functools.cache
def _platform_present(platform: str) -> bool:
    """Whether this process has devices of ``platform``."""
    try:
        return bool(jax.devices(platform))
    except RuntimeError:
        return False


def find(
    call: KernelCall, operands: tuple, *, asked: bool = True
) -> tuple[Kernel | None, list[str]]:
    """The first registered kernel for ``call``'s pattern and reduction that serves the
    operands ``(rows, cols, pairs, consts)``, and each declining kernel's reason; with
    ``asked=False`` (the default dispatch) only kernels with ``default=True``."""
    reasons: list[str] = []
    for kernel in _candidates(call.pattern.name, call.reduce, asked):
        why = kernel.declines(call, *operands)
        if why is None:
            return kernel, reasons
        reasons.append(f"{kernel.name} does not support {why}")
    return None, reasons


def points_on_one_device(call: KernelCall, pairs: Any) -> str | None:
    """What a kernel over the pairs of two point sets on one device declines in
    ``call``: points split over devices (a ring), batch dims, or pair operands; else
    ``None``."""
    if call.ring is not None:
        return "points split over devices (it runs on one device)"
    if call.batch:
        return "batch dims"
    if pairs:
        return "pair operands"
    return None


def may_serve(pattern: str, reduce: str, implementation: str | None) -> bool:
    """Whether a call of ``pattern`` and ``reduce`` with ``implementation`` may run a
    kernel in this process: ``"pallas"`` always (interpret mode where no platform of the
    kernel is present), ``None`` where a default kernel's platform is present. A caller
    that would give a kernel its operands in another form than the loops' best (one more
    elementwise pass over the points, say) asks this first, so that a CPU-only program
    stays the loops' own."""
    check_implementation(implementation)
    if implementation == "xla":
        return False
    asked = implementation == "pallas"
    return any(
        asked or any(map(_platform_present, k.platforms))
        for k in _candidates(pattern, reduce, asked)
    )


def _candidates(pattern: str, reduce: str, asked: bool) -> Iterator[Kernel]:
    """The registered kernels of ``pattern`` and ``reduce``, in the order they are tried;
    unless ``asked`` (``implementation="pallas"``), only those with ``default=True``."""
    return (
        k for k in _REGISTRY if k.pattern == pattern and k.reduce == reduce and (asked or k.default)
    )


def dispatch(
    call: KernelCall, operands: tuple, loops: Callable[..., Any], implementation: str | None
) -> Any:
    """The engine's result for ``operands = (rows, cols, pairs, consts)``, from a kernel
    or from ``loops`` (called with the same operands), as ``implementation`` asks (see
    the module docstring)."""
    check_implementation(implementation)
    if implementation == "xla":
        return loops(*operands)
    kernel, reasons = find(call, operands, asked=implementation == "pallas")
    if kernel is None:
        if implementation == "pallas":
            why = "; ".join(reasons) or f"no kernel is registered for {call.pattern.name}"
            raise ValueError(
                f"implementation='pallas' cannot serve this call: {why}. Pass "
                "implementation=None (the kernel where it serves, the XLA loops "
                "elsewhere) or 'xla'"
            )
        return loops(*operands)
    compiled = {p: functools.partial(kernel.apply, call, interpret=False) for p in kernel.platforms}
    default: Callable[..., Any]
    if implementation == "pallas":
        default = functools.partial(kernel.apply, call, interpret=True)
    elif any(_platform_present(p) for p in kernel.platforms):
        default = loops
    else:  # nowhere to run the kernel: trace nothing of it
        return loops(*operands)
    return jax.lax.platform_dependent(*operands, default=default, **compiled)


@contextlib.contextmanager
def trace_config(dtype: Any) -> Iterator[None]:
    """The configuration a TPU kernel is traced under: 32-bit indices (under a
    session-wide ``jax_enable_x64`` an index map that divides an int32 program id by a
    Python int gives an int64, which Mosaic rejects with a bare ``TypeError``), and the
    MXU's native matmul precision for bfloat16 operands (a session-wide
    ``jax_default_matmul_precision="highest"`` would ask Mosaic for a float32
    contraction of bfloat16 vectors, which it rejects)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(jax.enable_x64(False))
        if jnp.dtype(dtype) == jnp.bfloat16:
            stack.enter_context(jax.default_matmul_precision("default"))
        yield


def one_at_a_time(
    fn: Callable[..., Any], when: Callable[[tuple], bool] | None = None
) -> Callable[..., Any]:
    """``fn`` whose ``vmap`` is a loop over the batch (``lax.map``), not a batched Pallas
    call: for a kernel whose TPU lowering cannot take the batch as one more grid axis (a
    buffer it addresses by hand in HBM, ``memory_space=ANY``, or reads whole from SMEM),
    and that fills the chip alone at each batch element. ``when(in_batched)`` (the
    arguments' batched flags, shaped like the arguments): loop only where it holds, else
    ``fn``'s own ``vmap``."""

    @jax.custom_batching.custom_vmap
    def call(*args: Any) -> Any:
        return fn(*args)

    @call.def_vmap
    def _vmap(axis_size: int, in_batched: Any, *args: Any) -> tuple[Any, Any]:
        del axis_size
        if when is not None and not when(tuple(in_batched)):
            return _own_vmap(fn, tuple(in_batched), args)
        leaves, tree = jax.tree.flatten(args)
        flags = jax.tree.leaves(in_batched)

        def one(batched: list[Any]) -> Any:
            it = iter(batched)
            own = [next(it) if flag else leaf for leaf, flag in zip(leaves, flags)]
            return call(*jax.tree.unflatten(tree, own))

        out = jax.lax.map(one, [leaf for leaf, flag in zip(leaves, flags) if flag])
        return out, jax.tree.map(lambda _: True, out)

    return call


def _empty_batches(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` whose ``vmap`` over an empty batch returns empty outputs without running
    it: Pallas's batching rule makes the batch one more grid axis, and a grid axis of
    length 0 gives block shapes larger than the arrays (a ``TypeError`` from the slice of
    its interpreter, where XLA's loops return empty results). Any other batch is
    ``fn``'s own ``vmap``. ``fn`` enters its own trace configuration: the rule may trace
    it again after the caller's ``with`` block has closed."""

    @jax.custom_batching.custom_vmap
    def call(*args: Any) -> Any:
        return fn(*args)

    @call.def_vmap
    def _vmap(axis_size: int, in_batched: Any, *args: Any) -> tuple[Any, Any]:
        in_batched = tuple(in_batched)
        if axis_size == 0:
            shapes = jax.tree.map(
                lambda a, b: jax.ShapeDtypeStruct(a.shape[1:] if b else a.shape, a.dtype),
                args,
                in_batched,
            )
            out = jax.eval_shape(fn, *shapes)
            empty = jax.tree.map(lambda s: jnp.zeros((0, *s.shape), s.dtype), out)
            return empty, jax.tree.map(lambda _: True, out)
        return _own_vmap(fn, in_batched, args)

    return call


def _own_vmap(fn: Callable[..., Any], in_batched: tuple, args: tuple) -> tuple[Any, Any]:
    """A ``custom_vmap`` rule's answer from ``fn``'s own ``vmap``: every output batched."""
    axes = jax.tree.map(lambda b: 0 if b else None, in_batched)
    out = jax.vmap(fn, in_axes=axes)(*args)
    return out, jax.tree.map(lambda _: True, out)


def first_order(message: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` for a kernel's launch: its derivative raises ``TypeError(message)``
    when traced (a kernel's own backward has no derivative; JAX would raise a bare
    ``NotImplementedError`` from inside the Pallas call), and its ``vmap`` over an empty
    batch returns empty outputs (see :func:`_empty_batches`)."""
    return _first_order(message, _empty_batches(fn), *args)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _first_order(message: str, fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


@_first_order.defjvp
def _first_order_jvp(message, fn, primals, tangents):
    raise TypeError(message)
