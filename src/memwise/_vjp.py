"""The custom-VJP toolkit every memwise primitive is built with.

memwise's primitives (the tile engine, ``scan``/``while_loop``, ``linearize``) are
``jax.custom_vjp`` functions declared once, at module level, with their static parts
(the user's converted function, the tiling, the schedule) as non-differentiable
arguments, and with ``symbolic_zeros=True`` so that the forward rule learns which inputs
are differentiated ("perturbed") and the backward rule can skip the cotangents nobody
asked for (``grad`` with respect to parameters never builds the cotangent of the data).

This module holds the small pieces those rules share:

* :func:`custom_vjp` declares such a function (``@functools.partial(custom_vjp,
  nondiff_argnums=...)``, then ``.defvjp(fwd, bwd)``) so that its rules see the same
  arguments under both of JAX's custom-VJP implementations (see :class:`CustomVJP`);
* :func:`unwrap` splits ``CustomVJPPrimal`` inputs into values and perturbed flags;
* :class:`Static` carries such flags (or any hashable Python data) through the
  residuals, which must be a pytree of arrays: it is a pytree with no leaves;
* :func:`select` / :func:`fill` / :func:`cotangents` move between a full list of values
  and the sublist a ``jax.vjp`` differentiates, and back to the list of cotangents a
  backward rule returns (``None`` for a zero);
* :func:`is_zero` / :func:`dense` recognise and instantiate symbolic-zero cotangents;
* :func:`add` accumulates cotangents in a loop carry;
* :func:`closure_convert` makes every traced value a user's function closes over an
  explicit argument of the custom VJP, integers and booleans included.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from memwise._jax_private import forbid_forward_mode, is_unsupported_forward_mode

__all__ = [
    "custom_vjp",
    "CustomVJP",
    "Static",
    "unwrap",
    "select",
    "fill",
    "cotangents",
    "is_zero",
    "dense",
    "is_differentiable",
    "guard_forward_mode",
    "add",
    "closure_convert",
]


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Static:
    """Python data carried through ``custom_vjp`` residuals (a pytree without leaves).

    Example::

        >>> import jax
        >>> jax.tree.leaves((Static((True, False)), 1.0))
        [1.0]
    """

    value: Any


class CustomVJP:
    """A ``jax.custom_vjp`` with symbolic zeros whose rules see the same arguments under
    both of JAX's implementations (the default one and ``jax_custom_vjp3``).

    Why: JAX is moving ``custom_vjp`` to a reimplementation (``jax_custom_vjp3``, off by
    default in JAX 0.10), which differs from the default in two ways that reach memwise's
    rules. Its forward rule gets *every* argument as ``CustomVJPPrimal`` leaves, the
    non-differentiable ones too (the default passes those as they are), so a forward rule
    reading the static spec's fields fails; and forward mode raises a bare
    ``NotImplementedError`` instead of the default's ``TypeError``. The forward rule is
    therefore called with the non-differentiable arguments unwrapped, and that error is
    raised as a ``TypeError`` (where it surfaces in this call: under ``jvp`` of an
    enclosing ``jit`` JAX raises it outside). The flag is read when the function is
    declared (JAX picks the implementation then), i.e. when memwise is imported.

    Args:
      fun: the primal function; its static parts are the ``nondiff_argnums`` arguments.
      nondiff_argnums: positions of the non-differentiable (static, hashable) arguments.
      forward_mode_error: the forward-mode ``TypeError``'s message, from the static
        arguments (default: JAX's own wording).
    """

    def __init__(
        self,
        fun: Callable,
        *,
        nondiff_argnums: tuple[int, ...],
        forward_mode_error: Callable[..., str] | None = None,
    ) -> None:
        self._rule = jax.custom_vjp(fun, nondiff_argnums=nondiff_argnums)
        self._nondiff_argnums = frozenset(nondiff_argnums)
        self._forward_mode_error = forward_mode_error
        functools.update_wrapper(self, fun)

    def defvjp(self, fwd: Callable, bwd: Callable) -> None:
        """Define the rules (with ``symbolic_zeros=True``): ``fwd(*args)`` receives
        ``CustomVJPPrimal`` leaves for the differentiable arguments only, ``bwd(*static,
        residuals, cotangent)`` as with ``jax.custom_vjp``."""
        nondiff = self._nondiff_argnums

        @functools.wraps(fwd)
        def forward(*args):
            return fwd(*(_plain(a) if i in nondiff else a for i, a in enumerate(args)))

        self._rule.defvjp(forward, bwd, symbolic_zeros=True)

    def __call__(self, *args: Any) -> Any:
        try:
            return self._rule(*args)
        except NotImplementedError as error:
            if not is_unsupported_forward_mode(error):
                raise
            static = [a for i, a in enumerate(args) if i in self._nondiff_argnums]
            message = (
                self._forward_mode_error(*static)
                if self._forward_mode_error is not None
                else "can't apply forward-mode autodiff (jvp) to a custom_vjp function; "
                "use reverse mode (jax.grad, jax.vjp, jax.jacrev)"
            )
            raise TypeError(message) from error


def custom_vjp(
    fun: Callable,
    *,
    nondiff_argnums: tuple[int, ...],
    forward_mode_error: Callable[..., str] | None = None,
) -> CustomVJP:
    """Declare ``fun`` as a :class:`CustomVJP` (use as ``functools.partial`` decorator).

    Example::

        >>> import functools, jax, jax.numpy as jnp
        >>> @functools.partial(custom_vjp, nondiff_argnums=(0,))
        ... def scale(factor, x):
        ...     return factor * x
        >>> def scale_fwd(factor, x):
        ...     return factor * x.value, None
        >>> def scale_bwd(factor, _, ct):
        ...     return (factor * ct,)
        >>> scale.defvjp(scale_fwd, scale_bwd)
        >>> float(jax.grad(lambda x: scale(3.0, x))(1.0))
        3.0
    """
    return CustomVJP(fun, nondiff_argnums=nondiff_argnums, forward_mode_error=forward_mode_error)


def _plain(static: Any) -> Any:
    """A non-differentiable argument without ``jax_custom_vjp3``'s ``CustomVJPPrimal``."""
    wrapped = lambda leaf: isinstance(leaf, CustomVJPPrimal)  # noqa: E731
    if not any(wrapped(leaf) for leaf in jax.tree.leaves(static, is_leaf=wrapped)):
        return static  # the default implementation: passed as it is
    return jax.tree.map(
        lambda leaf: leaf.value if isinstance(leaf, CustomVJPPrimal) else leaf,
        static,
        is_leaf=wrapped,
    )


def unwrap(primals: Sequence[Any]) -> tuple[list, tuple[bool, ...]]:
    """``(values, perturbed flags)`` of ``custom_vjp(symbolic_zeros=True)`` primal inputs.

    Values are arrays: ``jax_custom_vjp3`` under ``jax.checkpoint`` passes a program's
    integer and float literals as Python scalars (``TypedInt``, ``TypedFloat``), which
    have no ``shape``; ``jnp.asarray`` gives the same (weakly typed) array type.
    """
    values = [p.value if hasattr(p.value, "shape") else jnp.asarray(p.value) for p in primals]
    return values, tuple(bool(p.perturbed) for p in primals)


def select(values: Sequence[Any], flags: Sequence[bool]) -> list:
    """The values whose flag is True, in order."""
    return [v for v, f in zip(values, flags) if f]


def fill(values: Sequence[Any], flags: Sequence[bool], chosen: Sequence[Any]) -> list:
    """``values`` with the flagged entries replaced by ``chosen`` (inverse of select)."""
    it = iter(chosen)
    return [next(it) if f else v for v, f in zip(values, flags)]


def cotangents(flags: Sequence[bool], chosen: Sequence[Any]) -> list:
    """A backward rule's cotangent list: ``chosen`` where flagged, ``None`` (zero) elsewhere."""
    it = iter(chosen)
    return [next(it) if f else None for f in flags]


def is_zero(ct: Any) -> bool:
    """True for a symbolic-zero cotangent (an output nobody differentiated)."""
    return isinstance(ct, SymbolicZero)


def dense(ct: Any, like: Any = None) -> Any:
    """A cotangent pytree with symbolic zeros instantiated as arrays of zeros.

    ``like`` (shapes and dtypes, optional) gives the zeros' type; without it the
    symbolic zero's own aval is used.
    """
    if like is None:
        return jax.tree.map(
            lambda c: jnp.zeros(c.shape, c.dtype) if is_zero(c) else c, ct, is_leaf=is_zero
        )
    return jax.tree.map(
        lambda c, x: jnp.zeros(np.shape(x), jnp.result_type(x)) if is_zero(c) else c,
        ct,
        like,
        is_leaf=is_zero,
    )


def is_differentiable(leaf: Any) -> bool:
    """True for float and complex leaves (integer and boolean ones get no cotangent)."""
    return jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)


def guard_forward_mode(leaves: Sequence[Any], message: str) -> list:
    """``leaves``, each float one guarded so that forward mode through the custom VJP
    they enter raises ``TypeError(message)`` (naming the fix) instead of JAX's
    "can't apply forward-mode autodiff (jvp) to a custom_vjp function"; reverse mode and
    forward-over-reverse (``jax.hessian``) are unaffected, and no HLO is emitted.

    Example::

        >>> import jax
        >>> f = lambda x: guard_forward_mode([x], "use reverse mode")[0] * 2.0
        >>> float(jax.grad(f)(1.0))
        2.0
    """
    return [forbid_forward_mode(a, message) if is_differentiable(a) else a for a in leaves]


def add(acc: Sequence[Any], new: Sequence[Any]) -> list:
    """Accumulated cotangents plus new ones, cast to the accumulators' dtypes."""
    return [a + n.astype(a.dtype) for a, n in zip(acc, new)]


def closure_convert(fn: Callable, *examples: Any) -> tuple[Callable, list]:
    """``jax.closure_convert(fn, *examples)`` that hoists every traced constant.

    Returns ``(converted, consts)``: ``converted(*args, *consts)`` computes
    ``fn(*args)`` for arguments shaped like ``examples``, and ``consts`` are the traced
    values (tracers of an enclosing ``jit``, ``scan``, ``fori_loop``, ``cond`` branch,
    ``jax.checkpoint``, ``vmap`` or ``grad``) that ``fn`` reads from its closure.

    Why not ``jax.closure_convert`` itself: it hoists only the values that may carry a
    tangent (floating-point tracers) and leaves integer and boolean tracers inside the
    converted function. A custom VJP holds that function as static data and traces its
    rules later, elsewhere (the backward pass of an enclosing loop, the transpose of an
    enclosing ``jit``), where such a tracer is out of scope: JAX raises
    ``UnexpectedTracerError`` or "No constant handler". Here they are arguments too, of
    the custom VJP; their flags say they are not perturbed, so their cotangent is zero
    (``float0``). Concrete arrays stay inside the function as constants.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> hoisted = []
        >>> def scale(n):
        ...     converted, consts = closure_convert(lambda x: x * n, jnp.ones(2))
        ...     hoisted.append([str(c.dtype) for c in consts])
        ...     return converted(jnp.ones(2), *consts)
        >>> jax.jit(scale)(3)  # n is an int32 tracer of the jit: an argument, not a constant
        Array([3., 3.], dtype=float32)
        >>> hoisted
        [['int32']]
    """
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*examples)
    jaxpr = closed.jaxpr
    traced = [isinstance(c, jax.core.Tracer) for c in closed.consts]
    kept_vars = [v for v, t in zip(jaxpr.constvars, traced) if not t]
    hoisted_vars = [v for v, t in zip(jaxpr.constvars, traced) if t]
    consts = [c for c, t in zip(closed.consts, traced) if t]
    run = jax.extend.core.jaxpr_as_fun(
        jax.extend.core.ClosedJaxpr(
            jaxpr.replace(constvars=kept_vars, invars=list(jaxpr.invars) + hoisted_vars),
            [c for c, t in zip(closed.consts, traced) if not t],
        )
    )
    in_tree = jax.tree.structure(examples)
    out_tree = jax.tree.structure(out_shape)
    n_args = len(examples)

    def converted(*args_and_consts: Any) -> Any:
        args, hoisted = args_and_consts[:n_args], args_and_consts[n_args:]
        leaves, tree = jax.tree.flatten(args)
        if tree != in_tree:  # type: ignore[operator]  # jaxlib ships no stub for PyTreeDef
            raise TypeError(
                f"a closure-converted function takes arguments structured as {in_tree}, got {tree}"
            )
        return jax.tree.unflatten(out_tree, run(*leaves, *hoisted))

    return converted, consts
