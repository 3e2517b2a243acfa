"""What the backward pass of ``jax.grad`` keeps, grouped by the user's line that made it.

The compiler reports how many bytes a gradient's program holds, not which arrays they
are. This module lists the residuals the backward pass keeps (``jax.ad_checkpoint``'s
saved-residual analysis, restricted to the differentiated arguments, behind
``memwise._jax_private``), names each by the operation it differentiates
(``memwise._residual_labels``: ``tanh derivative``, not JAX's helper ``sub``) and groups
them by the ``file:line`` of user code that produced them, or by the argument they are
(:func:`residuals`, :class:`Residual`). It only traces, never compiles.

It also registers memwise's own files as library code with JAX's source-info filter, so
that residuals (and HLO metadata, read by :mod:`memwise.timeline`) made inside
``mw.scan`` or ``mw.chunked_map`` point at the user's line that called them.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from memwise import _arguments, _jax_private, _residual_labels
from memwise import timeline as _timeline
from memwise._item_bytes import value_bytes

__all__ = ["Residual", "residuals", "saved_residuals"]

# memwise/ (this file is memwise/measure/saved.py): every file under it is library code.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Residual:
    """Arrays the backward pass keeps that come from one source.

    ``source`` is ``file:line`` of the user code that produced them, or
    ``argument 'name'``; ``count`` arrays were grouped under it, ``shape``/``dtype`` are
    those of the largest, ``nbytes`` their total, ``what`` the producing operations.

    Example::

        >>> import jax.numpy as jnp, memwise as mw
        >>> mw.measure.residuals(lambda x: jnp.sum(jnp.sin(x)), jnp.ones(8))[0]
        Residual(shape=(8,), dtype='float32', nbytes=32, source='...', count=1,
                 what='cos')
    """

    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    source: str
    count: int = 1
    what: str = ""


_OUTPUT_RE = re.compile(r"^(?:output of|named) (?P<what>.+?) from (?P<where>.+)$")
_WHERE_RE = re.compile(r"^(?P<file>.+?):(?P<line>\d+)(?::\d+)?(?: \((?P<func>.*)\))?$")


def _parse_source(description: str) -> tuple[str, str]:
    """('file:line' or "argument 'x'", what) from a JAX saved-residual description."""
    if description.startswith("from the argument"):
        # leaves of one argument (params['w'], params[3], ...) are grouped under it
        name = description.removeprefix("from the argument").strip()
        return _timeline.argument_source(name), "argument"
    match = _OUTPUT_RE.match(description)
    if match is None:
        return description, ""
    where = _WHERE_RE.match(match["where"])
    location = f"{where['file']}:{where['line']}" if where else match["where"]
    # memwise's guard primitives (identities on mw.scan / mw.while_loop checkpoints) are
    # named for what they hold, not by their internal name
    what = match["what"]
    return location, "checkpoint" if what.startswith("memwise_") else what


# JAX records the innermost *user* frame of each operation it traces. Counting memwise's
# own files as library code, like JAX's, makes residuals (and HLO metadata) created inside
# mw.scan / mw.chunked_map point at the user's line that called them. JAX's traceback
# filtering keeps a separate list and is not changed. Registered once, at import, because
# JAX caches traces: a registration only around the report would miss earlier traces.
_jax_private.exclude_from_source_info(_PACKAGE_DIR)


def saved_residuals(
    fn: Callable, *args: Any, argnums: Sequence[int] = (0,), **kwargs: Any
) -> list[tuple[Any, str]]:
    """What ``jax.grad(fn, argnums)`` keeps for its backward pass: (aval, description).

    The same analysis as ``jax.ad_checkpoint.print_saved_residuals`` (only the printing
    variant is public in JAX 0.10), restricted to the arguments in ``argnums``: the others
    stay inputs of the traced program, so they are listed when the backward needs them and
    nothing is listed that only their (unrequested) gradient would need.
    """
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs))

    def vjp_of_selected(*flat):
        all_args, all_kwargs = jax.tree_util.tree_unflatten(tree, flat)

        def selected(*diff):
            full = list(all_args)
            for i, value in zip(argnums, diff):
                full[i] = value
            return fn(*full, **all_kwargs)

        return jax.vjp(selected, *(all_args[i] for i in argnums))

    closed, out_shape = jax.make_jaxpr(vjp_of_selected, return_shape=True)(*leaves)
    n_residuals = len(jax.tree_util.tree_leaves(out_shape[1]))
    debug = _jax_private.debug_info("memory_report", fn, args, kwargs)
    jaxpr = closed.jaxpr.replace(
        outvars=closed.jaxpr.outvars[len(closed.jaxpr.outvars) - n_residuals :],
        debug_info=debug._replace(result_paths=None),
    )
    names = debug.arg_names or ("",) * len(jaxpr.invars)
    saved = _jax_private.saved_residuals_of_jaxpr(jaxpr, names)
    # "tanh derivative", not the "sub" that tanh's differentiation rule computes
    return _residual_labels.name_derivatives(
        closed.jaxpr, len(closed.jaxpr.outvars) - n_residuals, saved
    )


def _group_residuals(raw: Sequence[tuple[Any, str]]) -> list[Residual]:
    groups: dict[str, list[tuple[Any, str]]] = {}
    for aval, description in raw:
        source, what = _parse_source(description)
        groups.setdefault(source, []).append((aval, what))
    residuals = []
    for source, members in groups.items():
        sizes = [value_bytes(a) for a, _ in members]
        largest = members[int(np.argmax(sizes))][0]
        whats = sorted({w for _, w in members if w})
        residuals.append(
            Residual(
                shape=tuple(int(d) for d in largest.shape),
                dtype=str(np.dtype(largest.dtype)),
                nbytes=int(sum(sizes)),
                source=source,
                count=len(members),
                what=", ".join(whats),
            )
        )
    residuals.sort(key=lambda r: (-r.nbytes, r.source))
    return residuals


def residuals(
    fn: Callable,
    *args: Any,
    argnums: int | Sequence[int] = 0,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    **kwargs: Any,
) -> tuple[Residual, ...]:
    """What ``jax.grad(fn, argnums)`` keeps for its backward pass, by source, largest first.

    Traces, never compiles: the ``residuals`` of :func:`memory_report` without the
    compiled totals, so it is cheap enough to ask about a program too large to compile.

    Example::

        >>> import jax.numpy as jnp, memwise as mw
        >>> kept = mw.measure.residuals(lambda x: jnp.sum(jnp.sin(x)), jnp.ones(8))
        >>> # sin's backward keeps cos(x)
        >>> [(r.what, r.shape, r.nbytes) for r in kept]
        [('cos', (8,), 32)]
    """
    fn, args, kwargs, nums = _arguments.prepare(
        fn,
        args,
        kwargs,
        grad=True,
        argnums=argnums,
        static_argnums=static_argnums,
        static_argnames=static_argnames,
    )
    with _arguments.static_hint(fn, args, kwargs):
        return tuple(_group_residuals(saved_residuals(fn, *args, argnums=nums, **kwargs)))
