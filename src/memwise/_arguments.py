"""The arguments of a call to measure, as ``jax.jit`` sees them, checked before tracing.

``memory_report``, ``compiled_memory`` and ``fit`` take a function and its arguments the
way ``jax.jit`` does, ``static_argnums``/``static_argnames`` included. Static arguments
are bound into the function and replaced by ``None`` (a pytree without leaves) in the
call, so positions, argument names and leaves still line up with the user's call (the
saved-residual analysis names arguments through them). Everything a trace would fail on
with a raw JAX traceback (a string or a function among the traced arguments, argnums out
of range or naming a static argument) is checked first, with a message that names the
argument and the fix.

It is also the one place for the check every primitive makes of its data arguments
(:func:`check_arrays`: a carry, the items to map over, the points of a reduction), so a
string or an object there is named by the primitive's own argument, never by JAX's
"not a valid JAX type"; and for the check of a count argument (:func:`positive_int`: a
chunk size, a number of checkpoints or branches; :func:`non_negative_int` where 0 is
allowed), in one wording.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "abstract",
    "as_array",
    "check_arrays",
    "check_static_options",
    "describe",
    "index_tuple",
    "non_negative_int",
    "positive_int",
    "prepare",
    "signature",
    "static_arguments",
    "static_hint",
]


def index_tuple(value: Any, name: str) -> tuple[int, ...]:
    """``argnums``-style input (an int or a sequence of ints, never bools) as a tuple."""
    items = (value,) if isinstance(value, int) else value
    try:
        items = tuple(items)
    except TypeError:
        items = None
    if items is None or not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
        raise TypeError(f"{name} must be an int or a tuple of ints, got {value!r}")
    return items


def _name_tuple(value: Any, name: str) -> tuple[str, ...]:
    items = (value,) if isinstance(value, str) else value
    try:
        items = tuple(items)
    except TypeError:
        items = None
    if items is None or not all(isinstance(n, str) for n in items):
        raise TypeError(f"{name} must be a str or a tuple of str, got {value!r}")
    return items


def _parameters(fn: Callable) -> dict[str, inspect.Parameter] | None:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # builtins and other callables without a signature
        return None


def _positional_names(params: dict[str, inspect.Parameter] | None) -> list[str]:
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in (params or {}).values() if p.kind in kinds]


def check_static_options(fn: Callable, static_argnums: Any, static_argnames: Any) -> None:
    """Checks ``static_argnums``/``static_argnames`` against ``fn``'s signature, as jax.jit."""
    nums = index_tuple(static_argnums, "static_argnums")
    names = _name_tuple(static_argnames, "static_argnames")
    params = _parameters(fn)
    if params is None:
        return
    kinds = {p.kind for p in params.values()}
    positional = _positional_names(params)
    if inspect.Parameter.VAR_POSITIONAL not in kinds:
        for i in nums:
            if not -len(positional) <= i < len(positional):
                raise ValueError(
                    f"static_argnums={static_argnums!r} is out of range: fn takes "
                    f"{len(positional)} positional argument(s) {positional}"
                )
    if inspect.Parameter.VAR_KEYWORD not in kinds:
        unknown = [n for n in names if n not in params]
        if unknown:
            raise ValueError(
                f"static_argnames={static_argnames!r} names no parameter of fn: {unknown}; "
                f"its parameters are {list(params)}"
            )


def static_arguments(
    fn: Callable,
    args: Sequence[Any],
    kwargs: dict,
    static_argnums: Any = (),
    static_argnames: Any = (),
) -> tuple[frozenset[int], frozenset[str]]:
    """Positions and keywords of the static arguments of ``fn(*args, **kwargs)``.

    As in ``jax.jit``, a name in ``static_argnames`` also marks that parameter's position
    and a position in ``static_argnums`` its name; negative positions count from the end.
    """
    check_static_options(fn, static_argnums, static_argnames)
    positional = _positional_names(_parameters(fn))
    nums = index_tuple(static_argnums, "static_argnums")
    names = set(_name_tuple(static_argnames, "static_argnames"))
    names |= {positional[i] for i in nums if 0 <= i < len(positional)}
    positions = {i % len(args) for i in nums if -len(args) <= i < len(args)}
    positions |= {i for i, name in enumerate(positional[: len(args)]) if name in names}
    return frozenset(positions), frozenset(k for k in kwargs if k in names)


def signature(
    args: Sequence[Any], kwargs: dict, positions: frozenset[int], keywords: frozenset[str]
) -> Any:
    """What ``jax.jit`` keys a call on: the traced arguments' tree structure, shapes and
    dtypes, and the static arguments' values (which must therefore be hashable)."""
    traced = (
        tuple(None if i in positions else a for i, a in enumerate(args)),
        {k: v for k, v in kwargs.items() if k not in keywords},
    )
    leaves, tree = jax.tree_util.tree_flatten(traced)
    shapes = tuple(
        (
            tuple(getattr(x, "shape", ())),
            str(getattr(x, "dtype", type(x).__name__)),
            _named_sharding(x),
        )
        for x in leaves
    )
    static = (
        tuple((i, args[i]) for i in sorted(positions)),
        tuple((k, kwargs[k]) for k in sorted(keywords)),
    )
    try:
        hash(static)
    except TypeError as error:
        raise TypeError(
            f"static arguments must be hashable, as for jax.jit ({error}); pass a tuple "
            "instead of a list, or a frozen dataclass"
        ) from None
    return tree, shapes, static


def abstract(
    args: Sequence[Any], kwargs: dict, positions: frozenset[int], keywords: frozenset[str]
) -> tuple[tuple, dict]:
    """The arguments with every traced array replaced by its ``jax.ShapeDtypeStruct``,
    sharding kept: a program split by its data is planned as it will run, per device."""

    def struct(x: Any) -> Any:
        if not hasattr(x, "shape"):
            return x
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=_named_sharding(x))

    def shaped(tree: Any) -> Any:
        return jax.tree_util.tree_map(struct, tree)

    return (
        tuple(a if i in positions else shaped(a) for i, a in enumerate(args)),
        {k: v if k in keywords else shaped(v) for k, v in kwargs.items()},
    )


def _named_sharding(x: Any) -> jax.sharding.NamedSharding | None:
    """``x``'s ``NamedSharding`` (an array or a ``jax.ShapeDtypeStruct`` split over a
    mesh), else None: where an array sits on one device, it says nothing a plan needs.

    A traced value's type holds only an abstract mesh (under ``jit``, the mesh of the
    arrays it traces): it is made concrete over this process's devices, as many as it
    names, so that a plan compiled apart is split as the traced program is (each device
    of a mesh holds the same share, so which device is which does not change a plan).
    """
    if isinstance(x, jax.core.Tracer):
        sharding: Any = getattr(jax.typeof(x), "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        if mesh is None or not mesh.axis_names or mesh.size > len(jax.devices()):
            return None
        concrete = jax.make_mesh(
            mesh.axis_sizes,
            mesh.axis_names,
            axis_types=mesh.axis_types,
            devices=jax.devices()[: mesh.size],
        )
        return jax.sharding.NamedSharding(concrete, sharding.spec)
    sharding = getattr(x, "sharding", None)
    return sharding if isinstance(sharding, jax.sharding.NamedSharding) else None


def describe(fn: Callable, where: int | str) -> str:
    """``argument 2 ('n_layers')`` or ``keyword argument 'mode'``, for messages."""
    if isinstance(where, str):
        return f"keyword argument {where!r}"
    positional = _positional_names(_parameters(fn))
    return f"argument {where}" + (f" ({positional[where]!r})" if where < len(positional) else "")


# NumPy dtype kinds JAX cannot hold: strings, bytes, Python objects, dates and times.
_NOT_NUMERIC = frozenset("USOMm")


def _is_array_like(leaf: Any) -> bool:
    if isinstance(leaf, (bool, int, float, complex)) or hasattr(leaf, "__jax_array__"):
        return True
    dtype = getattr(leaf, "dtype", None)
    # getattr: JAX's extended dtypes (PRNG keys) are arrays without a NumPy kind
    return (
        hasattr(leaf, "shape")
        and dtype is not None
        and getattr(dtype, "kind", "") not in _NOT_NUMERIC
    )


def check_arrays(value: Any, arg: str) -> None:
    """Raises a ``TypeError`` naming ``arg`` unless every leaf of ``value`` is an array.

    Arrays (JAX or NumPy, of numbers or booleans) and Python numbers pass; a string, an
    object or an array of strings is named with its place in the pytree
    (``init['a'] must be an array, got 'abc' (type str)``), where JAX would say only that the value "is not a valid
    JAX type". Lists and tuples are pytrees, as everywhere in JAX: their items are the
    leaves.

    Example::

        >>> import jax.numpy as jnp
        >>> check_arrays({"w": jnp.ones(2), "n": 3}, "init")
        >>> check_arrays({"w": "abc"}, "init")
        Traceback (most recent call last):
        ...
        TypeError: init['w'] must be an array, got 'abc' (type str); pass a JAX or NumPy array ...
    """
    for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
        if not _is_array_like(leaf):
            kind = type(leaf).__name__
            if getattr(leaf, "dtype", None) is not None:
                kind = f"{kind}, dtype {leaf.dtype}"
            shown = repr(leaf) if len(repr(leaf)) <= 40 else repr(leaf)[:37] + "..."
            raise TypeError(
                f"{arg}{jax.tree_util.keystr(path)} must be an array, got {shown} (type {kind}); "
                "pass a JAX or NumPy array of numbers (or a pytree of them)"
            )


def as_array(value: Any, name: str) -> jax.Array:
    """``value`` (one array argument) as a JAX array, or a TypeError naming ``name`` (a
    string, None or a ragged list would otherwise reach JAX's own conversion error)."""
    if isinstance(value, (str, bytes)) or value is None:
        raise TypeError(f"{name} must be an array, got {value!r}; pass a JAX or NumPy array")
    try:
        return jnp.asarray(value)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"{name} must be an array (or a nested list of numbers), got {type(value).__name__}"
        ) from e


def _check_traceable(fn: Callable, args: Sequence[Any], kwargs: dict) -> None:
    """Every leaf of a non-static argument must be an array (or a number) jit can trace."""
    for where, value in [*enumerate(args), *kwargs.items()]:
        for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
            if not _is_array_like(leaf):
                option = (
                    f"static_argnames=({where!r},)"
                    if isinstance(where, str)
                    else f"static_argnums=({where},)"
                )
                raise TypeError(
                    f"{describe(fn, where)}{jax.tree_util.keystr(path)} is a "
                    f"{type(leaf).__name__}, which jax.jit cannot trace; pass it as static "
                    f"with {option}, or pass an array"
                )


def _check_argnums(
    fn: Callable, args: Sequence[Any], argnums: Any, positions: frozenset[int]
) -> tuple[int, ...]:
    nums = index_tuple(argnums, "argnums")
    if not nums:
        raise TypeError(f"argnums must be an int or a tuple of ints, got {argnums!r}")
    if not args:
        raise ValueError(
            f"grad=True differentiates the positional arguments chosen by argnums={argnums!r}, "
            "but fn was given no positional arguments; pass the arrays to differentiate "
            "positionally, or measure fn itself with grad=False"
        )
    for i in nums:
        if not -len(args) <= i < len(args):
            raise ValueError(
                f"argnums={argnums!r} is out of range for {len(args)} positional "
                f"argument(s); pass argnums between 0 and {len(args) - 1}"
            )
    nums = tuple(i % len(args) for i in nums)
    for i in nums:
        if i in positions:
            raise ValueError(
                f"argnums={argnums!r} names {describe(fn, i)}, which is static "
                "(static_argnums/static_argnames); differentiate array arguments only"
            )
        if not jax.tree_util.tree_leaves(args[i]):
            raise ValueError(
                f"argnums={argnums!r} names {describe(fn, i)}, which holds no arrays "
                f"({args[i]!r}); differentiate arguments that hold arrays"
            )
    return nums


def prepare(
    fn: Any,
    args: Sequence[Any],
    kwargs: dict,
    *,
    grad: bool,
    argnums: Any,
    static_argnums: Any,
    static_argnames: Any,
) -> tuple[Callable, tuple, dict, tuple[int, ...]]:
    """(fn with its static arguments bound, the positional arguments with None in place
    of the static ones, the keyword arguments without the static ones, the positions to
    differentiate): everything checked before anything is traced.

    None is a pytree without leaves, so positions, argument names and leaves line up with
    the user's call.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}: {fn!r}")
    if not isinstance(grad, bool):
        raise TypeError(f"grad must be True or False, got {grad!r}")
    positions, keywords = static_arguments(fn, args, kwargs, static_argnums, static_argnames)
    dynamic_args = tuple(None if i in positions else a for i, a in enumerate(args))
    dynamic_kwargs = {k: v for k, v in kwargs.items() if k not in keywords}
    _check_traceable(fn, dynamic_args, dynamic_kwargs)
    nums = _check_argnums(fn, args, argnums, positions) if grad else ()
    if not positions and not keywords:
        return fn, dynamic_args, dynamic_kwargs, nums
    static_args = {i: args[i] for i in positions}
    static_kwargs = {k: kwargs[k] for k in keywords}

    @functools.wraps(fn)  # keeps fn's parameter names for the residuals' sources
    def bound(*a, **kw):
        a = tuple(static_args.get(i, x) for i, x in enumerate(a))
        return fn(*a, **kw, **static_kwargs)

    return bound, dynamic_args, dynamic_kwargs, nums


_DEPENDS_ON = re.compile(r"depends on the value of the argument (\w+)")


@contextlib.contextmanager
def static_hint(
    fn: Callable, args: Sequence[Any] = (), kwargs: dict | None = None
) -> Iterator[None]:
    """Names the static option when ``fn`` uses a traced argument as a Python value.

    JAX's own error (an int in ``range``, an ``if`` on an argument, an argument in a
    slice) speaks of ``jit``, which the user did not call; memwise's functions take the
    same static options. ``args``/``kwargs`` are the traced arguments (None in place of
    static ones): a slice error does not say which argument it was, so the integer
    scalars among them are named as the likely ones.
    """
    try:
        yield
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError) as error:
        match = _DEPENDS_ON.search(str(error))
        if match is None:
            raise
        name, positional = match[1], _positional_names(_parameters(fn))
        option = (
            f"static_argnums=({positional.index(name)},)"
            if name in positional
            else f"static_argnames=({name!r},)"
        )
        raise TypeError(
            f"fn uses argument {name!r} as a Python value ({str(error).splitlines()[0]}), so "
            f"it cannot be traced; pass it as static with {option}"
        ) from error
    except IndexError as error:
        if "must be static" not in str(error):
            raise
        integers = [
            where
            for where, value in [*enumerate(args), *(kwargs or {}).items()]
            if _is_integer_scalar(value)
        ]
        positions = tuple(w for w in integers if isinstance(w, int))
        names = tuple(w for w in integers if isinstance(w, str))
        options = [f"static_argnums={positions}"] if positions else []
        options += [f"static_argnames={names}"] if names else []
        suspects = (
            f"; {', '.join(describe(fn, w) for w in integers)} "
            f"{'is an integer' if len(integers) == 1 else 'are integers'}: pass "
            f"{'it' if len(integers) == 1 else 'them'} as static with {' and '.join(options)}"
            if integers
            else "; pass the integers it uses as static with static_argnums or static_argnames"
        )
        raise TypeError(
            f"fn uses a traced argument in a slice or an index that must be a Python int "
            f"({str(error).splitlines()[0]}), so it cannot be traced{suspects}"
        ) from error


def positive_int(value: Any, name: str, *, accepts: str = "", fix: str = "") -> int:
    """``value`` as an int, after checking that it is a Python or NumPy int (not a bool)
    and >= 1: ``TypeError`` for another type, ``ValueError`` for an int below 1.

    One wording for every count argument: ``"{name} must be a positive int{accepts}, got
    {value!r}{fix}"``, where ``accepts`` names the other values the caller takes (``" or
    'auto'"``) and ``fix`` says what to pass instead. Example::

        >>> positive_int(4, "chunk_size")
        4
        >>> positive_int(0, "chunk_size", accepts=" or 'auto'")
        Traceback (most recent call last):
        ...
        ValueError: chunk_size must be a positive int or 'auto', got 0
    """
    return _int_at_least(value, 1, f"{name} must be a positive int{accepts}, got {value!r}{fix}")


def non_negative_int(value: Any, name: str, *, accepts: str = "", fix: str = "") -> int:
    """:func:`positive_int` for a count that may be 0: ``"{name} must be an int >=
    0{accepts}, got {value!r}{fix}"``.

    Example::

        >>> non_negative_int(0, "min_iterations")
        0
        >>> non_negative_int(-1, "degree", accepts=" (the order of the polynomial)")
        Traceback (most recent call last):
        ...
        ValueError: degree must be an int >= 0 (the order of the polynomial), got -1
    """
    return _int_at_least(value, 0, f"{name} must be an int >= 0{accepts}, got {value!r}{fix}")


def _int_at_least(value: Any, least: int, message: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(message)
    if value < least:
        raise ValueError(message)
    return int(value)


def _is_integer_scalar(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    dtype = getattr(value, "dtype", None)
    return getattr(value, "shape", None) == () and dtype is not None and "int" in str(dtype)
