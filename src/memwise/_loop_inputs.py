"""The loop inputs every loop executor checks and prepares alike (``scan``, ``while_loop``,
the reversible scan).

Why a module of its own: :mod:`memwise.scan` (the public face), :mod:`memwise._while` and
:mod:`memwise._reversible` all resolve ``checkpoints``, check that the body keeps the
carry's structure, shapes and dtypes (promoting a weakly typed init as ``lax.scan``
does), and turn the body into the flat, closure-converted loop the executors run. Kept
here, below all three, so that the executors import these pieces from one place and
nothing imports upwards into ``scan``.

Contents: :func:`resolve_checkpoints` (the slot count for ``checkpoints=``) and
:func:`checkpoint_count` (an int ``checkpoints`` checked, also for Diffrax's adjoint),
:func:`check_callable`, :func:`check_carry_structure` and :func:`carry_type_error` (a
changed carry structure or leaf type, with the fix), :func:`strong_carry` (the body's
carry check and weak-type promotion), :func:`flat_step` and :func:`loop_body` (the loop
as the executors run it: flat leaves, read-only carry leaves as constants, ``shard_map``
varying types).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
from jax import lax

from memwise import knobs
from memwise import schedule as schedule_lib
from memwise._arguments import positive_int
from memwise._jax_private import hoist_constant_casts, varying_axes
from memwise._vjp import closure_convert, fill, select
from memwise.sharding import first_items, vary, varying_over

__all__ = [
    "resolve_checkpoints",
    "checkpoint_count",
    "check_callable",
    "check_carry_structure",
    "carry_type_error",
    "strong_carry",
    "flat_step",
    "loop_body",
]

# checkpoints=None: the smallest count whose recomputation is at most one extra forward.
_DEFAULT_EVALUATIONS_PER_STEP = 3
# "auto" candidates: evaluations per step allowed, from fastest (most memory) to leanest.
_AUTO_EVALUATIONS_PER_STEP = (2.5, 3, 4, 6, 8, 12)


def resolve_checkpoints(checkpoints: Any, n: int) -> int:
    """The slot count ``scan`` uses for ``checkpoints`` (None, int, "all", "auto").

    ``None``: ``schedule.min_checkpoints(n, 3 n)``; ``"all"``: n; ``"auto"``: the choice
    of ``memwise.fit`` (the ``None`` choice outside it). Example::

        >>> resolve_checkpoints(None, 10_000)
        139
    """
    if checkpoints is None:
        return schedule_lib.min_checkpoints(n, _DEFAULT_EVALUATIONS_PER_STEP * n)
    if isinstance(checkpoints, str):
        if checkpoints == "all":
            return n
        if checkpoints == "auto":
            default = resolve_checkpoints(None, n)
            candidates = [n]
            for per_step in _AUTO_EVALUATIONS_PER_STEP:
                c = schedule_lib.min_checkpoints(n, int(per_step * n))
                if c < candidates[-1]:
                    candidates.append(c)
            return knobs.auto(
                "checkpoints",
                candidates=candidates,
                cost=lambda c: schedule_lib.evaluations(n, c) / (2 * n),
                default=default,
            )
        raise ValueError(
            f"checkpoints={checkpoints!r} is not understood; pass an int >= 1, None, "
            "'all' or 'auto'"
        )
    return min(checkpoint_count(checkpoints), n)


def checkpoint_count(checkpoints: Any) -> int:
    """An int ``checkpoints`` checked, in the wording of every loop that takes it (its
    other values, None, 'all' and 'auto', are :func:`resolve_checkpoints`')."""
    return positive_int(
        checkpoints,
        "checkpoints",
        accepts=" (the number of carries kept), None, 'all' or 'auto'",
        fix="; checkpoints=1 keeps the least memory",
    )


def check_callable(fn: Any, name: str) -> None:
    if not callable(fn):
        raise TypeError(f"{name} must be callable, got {type(fn).__name__}")


def _type_of(leaf: Any, *, init: bool = False) -> str:
    weak = " (weakly typed: a Python scalar)" if init and getattr(leaf, "weak_type", False) else ""
    return f"{leaf.dtype}{list(leaf.shape)}{weak}"


def check_carry_structure(init: Any, new: Any, mismatch: Callable[[Any, Any], str]) -> Any:
    """``init``'s pytree structure, after checking that ``new`` (a carry a body or an
    inverse returned) has it too; else ``TypeError(mismatch(init's, new's))``, the caller
    wording what returned the carry and the fix."""
    in_def = jax.tree_util.tree_structure(init)
    out_def = jax.tree_util.tree_structure(new)
    if in_def != out_def:  # type: ignore[operator]  # jaxlib ships no stub for PyTreeDef
        raise TypeError(mismatch(in_def, out_def))
    return in_def


def carry_type_error(name: str, path: Any, a: Any, b: Any) -> TypeError:
    where = f"carry{jax.tree_util.keystr(path)}" if path else "the carry"
    if a.shape != b.shape:
        fix = f"keep {where}'s shape {list(a.shape)} (reshape or index the new value)"
    elif getattr(a, "weak_type", False):
        fix = (
            f"return {where} as {a.dtype} (e.g. new.astype(jnp.result_type(old))), or "
            f"start from an init of the dtype {name} returns ({b.dtype})"
        )
    else:
        fix = f"cast the new value to the init's dtype (new.astype(jnp.{a.dtype}))"
    return TypeError(
        f"{name} changed the type of {where}: init is {_type_of(a, init=True)} but {name} returned "
        f"{_type_of(b)}; a loop carry keeps its shape and dtype, as in jax.lax.scan and "
        f"jax.lax.while_loop: {fix}"
    )


def strong_carry(
    f: Callable, init: Any, x_example: Any, *, name: str = "f"
) -> tuple[Any, list[bool]]:
    """Checks that f keeps the carry's structure, shapes and dtypes: ``(init, read_only)``.

    As in ``lax.scan`` and ``lax.while_loop``, a weakly typed init leaf (a Python float)
    is first promoted with the dtype the body returns (``jnp.result_type``), so
    ``init=0.0`` works with a float32 body, and the body is traced again on the promoted
    init; a body that still returns another dtype (a float init returned as int32) is
    an error, never a silent cast. ``read_only[i]`` is True when f returns carry leaf i
    unchanged (the same value, not a copy).
    """
    init = jax.tree_util.tree_map(jnp.asarray, init)
    closed, out = jax.make_jaxpr(f, return_shape=True)(init, x_example)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(f"{name} must return a pair (new_carry, y); got {type(out).__name__}")
    new_carry = out[0]
    in_def = check_carry_structure(
        init,
        new_carry,
        lambda in_def, out_def: (
            f"{name} changed the carry's structure: init is {in_def} but {name} returned "
            f"{out_def}; return a carry with the same pytree structure as init"
        ),
    )
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(init)[0]]
    leaves = jax.tree_util.tree_leaves(init)
    promoted = False
    for i, (path, a, b) in enumerate(zip(paths, leaves, jax.tree_util.tree_leaves(new_carry))):
        if a.shape == b.shape and a.dtype == b.dtype:
            continue
        if a.shape != b.shape or not getattr(a, "weak_type", False):
            raise carry_type_error(name, path, a, b)
        dtype = jnp.result_type(a, b.dtype)
        if dtype != b.dtype:
            raise carry_type_error(name, path, a, b)
        leaves[i] = lax.convert_element_type(a, dtype)
        promoted = True
    if promoted:  # the body may type its output by its input's: check it on the new init
        return strong_carry(f, jax.tree_util.tree_unflatten(in_def, leaves), x_example, name=name)
    n = len(leaves)
    jaxpr = closed.jaxpr
    read_only = [o is i for o, i in zip(jaxpr.outvars[:n], jaxpr.invars[:n])]
    return init, read_only


def loop_body(
    flat: Callable, carry: list, xs: list, read_only: list, *, item: Callable = first_items
) -> tuple[Callable, list, list, list]:
    """The loop as ``_binomial`` runs it: ``(body, consts, loop_carry, xs)``.

    The read-only carry leaves (``flat`` returns them unchanged) leave the loop carry
    and become closed-over constants, as in ``lax.scan``: they keep their own value
    (unbatched under ``vmap`` when they were), cost no checkpoint slot, and their
    gradient flows as a constant's.

    Inside ``shard_map`` the loop carry and xs are cast to vary like the loop's inputs
    (the carry as far as the body makes it vary: the fixed point that ``lax.scan`` asks
    the user to cast to), and the body's casts of replicated closed-over arrays are
    applied once, before the loop: the backward loop then accumulates local partial
    cotangents, and each cast's transpose all-reduces a replicated input's cotangent
    once, after the loop (``lax.scan`` all-reduces a replicated parameter's every step).

    ``item(xs)`` is what one step receives of ``xs`` (one row; a while loop's buffers
    whole).
    """
    moving = [not r for r in read_only]

    def step(loop_carry, x):
        new_carry, y = flat(fill(carry, moving, loop_carry), x)
        return [vary(a, varying_axes(c)) for a, c in zip(select(new_carry, moving), loop_carry)], y

    loop_carry = select(carry, moving)
    body, consts = closure_convert(step, loop_carry, item(xs))
    axes = varying_over(loop_carry, xs, consts)
    if not axes:
        return body, list(consts), loop_carry, xs
    xs = vary(xs, axes)
    while True:
        out, _ = jax.eval_shape(step, loop_carry, item(xs))
        if all(varying_axes(o) <= varying_axes(c) for o, c in zip(out, loop_carry)):
            break
        loop_carry = [vary(c, varying_axes(o)) for c, o in zip(loop_carry, out)]
    closed, out = jax.make_jaxpr(step, return_shape=True)(loop_carry, item(xs))
    jaxpr, consts = hoist_constant_casts(closed)
    run = jax.extend.core.jaxpr_as_fun(jax.extend.core.ClosedJaxpr(jaxpr, []))
    out_tree = jax.tree.structure(out)

    def hoisted_body(loop_carry, x, *consts):
        return jax.tree.unflatten(out_tree, run(*consts, *loop_carry, *x))

    return hoisted_body, consts, loop_carry, xs


def flat_step(f, carry_def, x_def, y_def_box):
    def step(carry_leaves, x_leaves):
        carry = jax.tree_util.tree_unflatten(carry_def, carry_leaves)
        x = jax.tree_util.tree_unflatten(x_def, x_leaves)
        new_carry, y = f(carry, x)
        y_leaves, y_def = jax.tree_util.tree_flatten(y)
        y_def_box[:] = [y_def]
        return jax.tree_util.tree_leaves(new_carry), y_leaves

    return step
