"""Which closed-over objects hold the arrays a compiled program carries as constants.

Under ``jax.jit`` (and ``pmap``) an array a function closes over, rather than takes as an
argument, is baked into the program as a constant: its bytes are part of the program
text, and a copy of the weights travels with every compilation. ``memory_report`` warns
when such constants are large; this module lets the warning say *which* object holds
them. The traced program's constants are the closed-over arrays themselves (tracing keeps
them, it does not copy them), so they are matched by identity against the array leaves
of what the function can reach: its free variables, the globals it names (in nested
functions too), a ``functools.partial``'s arguments and a bound method's object, and,
a few levels deep, the functions among those.

A :class:`memwise.linearize.Linearized` is recognised as such: its leaves are the
linearization point, and closing over it re-bakes the weights that ``mw.linearize``
exists to keep out of the program; the fix is to pass it to the step as an argument.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from memwise._display import format_bytes
from memwise.linearize import Linearized

__all__ = ["Holder", "holders", "warning"]

# Functions inside functions inside the measured one: deep enough for a step that calls a
# loss that calls a model, shallow enough to stay out of libraries' internals.
_MAX_DEPTH = 3
_LINEARIZE_HINT = " (a linearized network: mw.linearize keeps its parameters as pytree leaves)"


@dataclasses.dataclass(frozen=True)
class Holder:
    """A closed-over object whose array leaves are constants of the program.

    Attributes:
      name: the name it is reached by (a variable, ``self.lin``, ``partial argument 1``).
      owner: the name of the function that closes over it.
      nbytes: the bytes of the program's constants that are its leaves.
      linearized: whether it is a ``mw.linearize`` result.
    """

    name: str
    owner: str
    nbytes: int
    linearized: bool


def holders(fn: Callable, consts: Sequence[Any]) -> tuple[Holder, ...]:
    """The objects reachable from ``fn`` that hold ``consts``, largest first.

    Each constant is counted once, for the first holder found, ``mw.linearize`` results
    first (a Linearized and the parameter pytree it was built from share their leaves).
    """
    wanted = {id(c): c for c in consts if hasattr(c, "shape")}
    if not wanted:
        return ()
    found: list[tuple[str, str, Any, set[int]]] = []
    for name, owner, value in _reachable(fn):
        ids = {id(leaf) for leaf in _leaves(value)} & wanted.keys()
        if ids:
            found.append((name, owner, value, ids))
    found.sort(key=lambda item: not isinstance(item[2], Linearized))
    claimed: set[int] = set()
    out = []
    for name, owner, value, ids in found:
        ids -= claimed
        if ids:
            claimed |= ids
            nbytes = sum(int(np.asarray(wanted[i]).nbytes) for i in ids)
            out.append(Holder(name, owner, nbytes, isinstance(value, Linearized)))
    return tuple(sorted(out, key=lambda h: -h.nbytes))


def warning(constant_bytes: int, found: Sequence[Holder]) -> str:
    """The report's warning about ``constant_bytes`` of constants held by ``found``."""
    head = (
        f"warning: {format_bytes(constant_bytes)} of arrays are baked into the program as "
        "constants (closed-over arrays)"
    )
    linearized = [h for h in found if h.linearized]
    if linearized:
        h = linearized[0]
        return (
            f"{head}; {format_bytes(h.nbytes)} of them are the parameters of {h.name!r}, a "
            f"mw.linearize result that {h.owner!r} closes over: pass it to the jitted or "
            "pmapped step as an argument instead, e.g. step(params, lin, batch) calling "
            "lin(params, x) (a Linearized is a pytree whose leaves are its parameters: as "
            "an argument they stay out of the program)"
        )
    if found:
        named = ", ".join(
            f"{h.name!r} ({format_bytes(h.nbytes)}, closed over by {h.owner!r})" for h in found[:3]
        )
        return f"{head}, held by {named}; pass them as arguments{_LINEARIZE_HINT}"
    return f"{head}; pass them as arguments{_LINEARIZE_HINT}"


def _leaves(value: Any) -> list:
    # Functions are leaves of themselves, except pytrees such as jax.tree_util.Partial
    # (what jax.linearize returns), whose leaves are the arrays they carry.
    if isinstance(value, (types.ModuleType, type)):
        return []
    try:
        return jax.tree.leaves(value)
    except Exception:  # an object whose flattening fails is no holder of arrays
        return []


def _is_function(value: Any) -> bool:
    return isinstance(
        value, (types.FunctionType, types.MethodType, functools.partial, types.BuiltinFunctionType)
    )


def _name(fn: Any) -> str:
    if isinstance(fn, types.MethodType):
        return f"{type(fn.__self__).__name__}.{fn.__func__.__name__}"
    return getattr(fn, "__name__", None) or type(fn).__name__


def _reachable(fn: Callable) -> Iterator[tuple[str, str, Any]]:
    """``(name, owner, value)`` for what ``fn`` closes over, functions searched too."""
    seen: set[int] = set()
    stack = [(fn, 0)]
    while stack:
        current, depth = stack.pop()
        current = _unwrap(current)
        if id(current) in seen:
            continue
        seen.add(id(current))
        owner = _name(current)
        for name, value in _referenced(current):
            yield name, owner, value
            if depth < _MAX_DEPTH and callable(value) and _is_function(_unwrap(value)):
                stack.append((value, depth + 1))


def _unwrap(fn: Any) -> Any:
    try:  # jax.jit and functools.wraps keep the function in __wrapped__
        return inspect.unwrap(fn)
    except ValueError:  # a cycle of __wrapped__
        return fn


def _referenced(fn: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(fn, functools.partial):
        yield from ((f"partial argument {i}", a) for i, a in enumerate(fn.args))
        yield from fn.keywords.items()
        yield _name(fn.func), fn.func
        return
    if isinstance(fn, types.MethodType):
        yield from _attributes(fn.__self__)
        fn = fn.__func__
    elif not isinstance(fn, (types.FunctionType, types.BuiltinFunctionType)):
        # A callable object (a model class): its attributes, then its __call__'s names.
        yield from _attributes(fn)
        fn = getattr(type(fn).__call__, "__func__", type(fn).__call__)
    if not isinstance(fn, types.FunctionType):
        return
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        try:
            yield name, cell.cell_contents
        except ValueError:  # a cell not yet assigned
            continue
    for name in sorted(_global_names(fn.__code__)):
        if name in fn.__globals__:
            yield name, fn.__globals__[name]


def _attributes(obj: Any) -> Iterator[tuple[str, Any]]:
    yield from ((f"self.{k}", v) for k, v in sorted(getattr(obj, "__dict__", {}).items()))
    yield "self", obj


def _global_names(code: types.CodeType) -> set[str]:
    """Names a code object and the functions defined in it look up (``co_names`` also
    holds attribute names, which match no global or a harmless one)."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names
