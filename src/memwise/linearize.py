"""Linearized networks whose parameters stay arguments, with a training-sized gradient.

``linearize(f, params)`` is the first-order Taylor expansion of ``f`` in its parameters
(Lee et al. 2019, "Wide neural networks of any depth evolve as linear models under
gradient descent"):

    lin(new_params, *inputs) = f(params, *inputs) + J(params, *inputs) (new_params - params)

neural-tangents' ``nt.linearize`` returns a Python closure over ``params``; under ``jit``
or ``pmap`` the closed-over arrays become constants of the compiled program, so a model's
weights are copied into the executable (8 MiB of parameters gave 16 MiB of program text;
a ViT's hundreds of MiB made loading the program fail even at batch size 1, the neural-tangents issue 144 report).
Here the result is a pytree whose leaves *are* the linearization point: passed to a
jitted step it arrives as an argument, never as a constant.

Its gradient w.r.t. ``new_params`` is a ``jax.custom_vjp``: the forward pass is one
``jax.jvp`` of ``f`` (it keeps nothing but the arguments), the backward pass one
``jax.vjp`` of ``f`` at the linearization point applied to the output cotangent (J^T ct,
exact because ``lin`` is linear in ``new_params``). So a training step of the linearized
model holds what a training step of ``f`` holds, plus about two output-sized buffers,
for about one extra forward pass of compute, whatever ``f``'s jvp rules save. (For plain
JAX layers, differentiating the jvp directly with the parameters as arguments keeps
about as much; the closure over the parameters is what made the neural-tangents issue 144 report fail.) When the
linearization point or the inputs are differentiated too, the exact gradient of the jvp
is taken instead.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from memwise._vjp import Static, cotangents, dense, fill, is_differentiable, select, unwrap

__all__ = ["Linearized", "linearize"]


def _is_array(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


class _Skeleton:
    """A pytree's structure and its non-array leaves (functions, ints, strings), kept
    out of the traced arguments; the array leaves travel separately.

    Compared by identity: a Linearized made once and passed to a jitted step many times
    hits the compilation cache, and nothing here is ever hashed by value.
    """

    def __init__(self, treedef: Any, is_dynamic: tuple[bool, ...], static_leaves: tuple):
        self.treedef = treedef
        self.is_dynamic = is_dynamic
        self.static_leaves = static_leaves

    def rebuild(self, dynamic_leaves: list) -> Any:
        dynamic = iter(dynamic_leaves)
        static = iter(self.static_leaves)
        leaves = [next(dynamic) if d else next(static) for d in self.is_dynamic]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


def _split(tree: Any) -> tuple[list, _Skeleton]:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    is_dynamic = tuple(_is_array(leaf) for leaf in leaves)
    dynamic = [leaf for leaf, d in zip(leaves, is_dynamic) if d]
    static = tuple(leaf for leaf, d in zip(leaves, is_dynamic) if not d)
    return dynamic, _Skeleton(treedef, is_dynamic, static)


@dataclasses.dataclass(frozen=True, eq=False)
class _Apply:
    """The static parts of one linearized call (a nondiff argument of the custom_vjp).

    ``f(point_leaves, operands)`` is the user's function closure-converted: ``operands``
    are the array leaves of the inputs followed by the arrays ``f`` closes over, so that a
    closed-over value being differentiated (``jax.grad`` of a loss whose ``f`` uses it) is
    an argument of the custom_vjp, not a tracer leaking out of it.
    """

    f: Callable
    diff_mask: tuple[bool, ...]  # which leaves of the point are differentiable

    def of_point(self, point_leaves: list, operands: list) -> Callable:
        """``f`` as a function of the differentiable leaves of the point."""

        def of_diff(diff_leaves):
            return self.f(fill(point_leaves, self.diff_mask, diff_leaves), operands)

        return of_diff


def _convert(f: Callable, point: _Skeleton, point_leaves: list, inputs: _Skeleton,
             input_leaves: list) -> tuple[Callable, list]:
    """``f`` as a function of (point leaves, operands) and its closed-over arrays
    (``jax.closure_convert``, as every memwise custom VJP does)."""

    def flat(point_leaves, input_leaves):
        args, kwargs = inputs.rebuild(input_leaves)
        return f(point.rebuild(point_leaves), *args, **kwargs)

    converted, consts = jax.closure_convert(flat, point_leaves, input_leaves)
    n_inputs = len(input_leaves)

    def of_operands(point_leaves, operands):
        return converted(point_leaves, operands[:n_inputs], *operands[n_inputs:])

    return of_operands, input_leaves + list(consts)


def _same_static(old: Any, new: Any) -> bool:
    if old is new:
        return True
    try:
        return type(old) is type(new) and bool(old == new)
    except (TypeError, ValueError):  # no scalar equality: only the same object is the same
        return False


def _value(spec: _Apply, point_leaves, new_leaves, operands):
    primal = select(point_leaves, spec.diff_mask)
    # Subtract in the parameters' own dtype: the tangent must match the primal's.
    tangent = [
        jnp.asarray(n, p.dtype) - p for n, p in zip(select(new_leaves, spec.diff_mask), primal)
    ]
    out, out_tangent = jax.jvp(spec.of_point(point_leaves, operands), (primal,), (tangent,))
    return jax.tree_util.tree_map(jnp.add, out, out_tangent)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _apply(spec: _Apply, point_leaves, new_leaves, operands):
    return _value(spec, point_leaves, new_leaves, operands)


def _apply_fwd(spec, point_leaves, new_leaves, operands):
    (point_leaves, point_flags), (new_leaves, _), (operands, operand_flags) = (
        unwrap(group) for group in (point_leaves, new_leaves, operands)
    )
    if any(point_flags) or any(operand_flags):
        # The point, the inputs or arrays f closes over are differentiated too: the
        # exact vjp of the jvp.
        out, full_vjp = jax.vjp(functools.partial(_value, spec), point_leaves, new_leaves,
                                operands)
        return out, (Static(True), full_vjp)
    return _value(spec, point_leaves, new_leaves, operands), (
        Static(False), (point_leaves, operands)
    )


def _apply_bwd(spec, residuals, cotangent):
    full, data = residuals
    cotangent = dense(cotangent)
    if full.value:
        return data(cotangent)
    point_leaves, operands = data
    # lin is linear in new_params: its vjp is J^T ct at the linearization point.
    _, f_vjp = jax.vjp(spec.of_point(point_leaves, operands),
                       select(point_leaves, spec.diff_mask))
    (diff_cotangent,) = f_vjp(cotangent)
    return (
        [None] * len(point_leaves),
        cotangents(spec.diff_mask, diff_cotangent),
        [None] * len(operands),
    )


_apply.defvjp(_apply_fwd, _apply_bwd, symbolic_zeros=True)


@jax.tree_util.register_pytree_node_class
class Linearized:
    """``f`` linearized around ``params``; a pytree whose leaves are the array leaves of
    ``params``. Call it as ``lin(new_params, *inputs, **kwargs)``.

    Attributes:
      f: the function that was linearized, ``f(params, *inputs, **kwargs)``.
      params: the linearization point (same structure as passed to :func:`linearize`).
    """

    def __init__(self, f: Callable, leaves: list, static: _Skeleton):
        self.f = f
        self._leaves = list(leaves)
        self._static = static

    @property
    def params(self) -> Any:
        return self._static.rebuild(self._leaves)

    def tree_flatten(self):
        return (self._leaves,), (self.f, self._static)

    @classmethod
    def tree_unflatten(cls, aux, children):
        f, static = aux
        (leaves,) = children
        return cls(f, leaves, static)

    def __repr__(self) -> str:
        name = getattr(self.f, "__name__", type(self.f).__name__)
        return f"Linearized({name}, {len(self._leaves)} parameter arrays)"

    def __call__(self, new_params: Any, *inputs: Any, **kwargs: Any) -> Any:
        new_leaves, new_static = _split(new_params)
        if (
            new_static.treedef != self._static.treedef
            or new_static.is_dynamic != self._static.is_dynamic
        ):
            raise ValueError(
                "new_params must have the structure of the linearization point: expected "
                f"{self._static.treedef}, got {new_static.treedef}"
            )
        for old, new in zip(self._leaves, new_leaves):
            if jnp.shape(old) != jnp.shape(new):
                raise ValueError(
                    f"new_params has a leaf of shape {jnp.shape(new)} where the "
                    f"linearization point has {jnp.shape(old)}"
                )
        # f runs with the point's non-array leaves: a changed one in new_params would be
        # silently ignored.
        static_paths = [
            jax.tree_util.keystr(path)
            for path, leaf in jax.tree_util.tree_flatten_with_path(new_params)[0]
            if not _is_array(leaf)
        ]
        for path, old, new in zip(
            static_paths, self._static.static_leaves, new_static.static_leaves
        ):
            if not _same_static(old, new):
                raise ValueError(
                    f"new_params{path} is {new!r} where the linearization point has "
                    f"{old!r}: non-array leaves (Python numbers, functions) are static parts "
                    "of the linearization point and cannot change. Linearize again at the "
                    "new point, or make the leaf an array to linearize in it too."
                )
        diff_mask = tuple(is_differentiable(leaf) for leaf in self._leaves)
        input_leaves, input_static = _split((inputs, kwargs))
        f, operands = _convert(self.f, self._static, self._leaves, input_static, input_leaves)
        return _apply(_Apply(f, diff_mask), self._leaves, new_leaves, operands)


def linearize(f: Callable, params: Any) -> Linearized:
    """The first-order Taylor expansion of ``f`` in ``params``, as a pytree.

    Args:
      f: ``f(params, *inputs, **kwargs)``, e.g. a Flax ``model.apply`` (with ``params``
        the variables dict), ``lambda model, x: model(x)`` for an Equinox module, or any
        function of a parameter pytree. It may close over arrays, traced ones included:
        they are differentiated like the inputs.
      params: the linearization point. Its array leaves become the leaves of the result;
        other leaves (functions, Python numbers) stay static: every ``new_params`` must
        carry the same ones (a ValueError names the leaf that changed).

    Returns:
      A :class:`Linearized` ``lin`` with ``lin(new_params, *inputs, **kwargs) =
      f(params, *inputs, **kwargs) + J (new_params - params)``, J the Jacobian of ``f``
      w.r.t. ``params`` at ``inputs``.

    Memory and compute: pass ``lin`` to your jitted step as an argument and the
    parameters are arguments of the compiled program, not constants. ``jax.grad`` w.r.t.
    ``new_params`` keeps no more than ``jax.grad`` of ``f`` (the forward is one jvp, the
    backward re-runs ``f`` under one vjp): about the memory of training ``f`` for about
    1.5x its compute. Differentiating w.r.t. the linearization point or the inputs is
    exact too but costs what differentiating a jvp costs. Forward mode (``jax.jvp`` of
    ``lin``) is not supported (a ``custom_vjp``) and raises a TypeError; for
    tangents use ``jax.jvp(f, (params,), (new_params - params,))`` directly.

    Example::

        >>> import jax, jax.numpy as jnp, memwise as mw
        >>> def f(params, x):
        ...     return jnp.tanh(x @ params["w"]) @ params["v"]
        >>> params = {"w": jnp.ones((3, 4)) / 3, "v": jnp.ones((4, 2))}
        >>> lin = mw.linearize(f, params)
        >>> x = jnp.ones((5, 3))
        >>> bool(jnp.allclose(lin(params, x), f(params, x)))
        True
        >>> loss = lambda p, lin, x: jnp.sum(lin(p, x) ** 2)
        >>> grads = jax.jit(jax.grad(loss))(params, lin, x)  # lin is an argument
    """
    if not callable(f):
        raise TypeError(f"f must be callable f(params, *inputs), got {type(f).__name__}")
    leaves, static = _split(params)
    if not any(is_differentiable(leaf) for leaf in leaves):
        raise TypeError(
            "params has no float array leaves to linearize in; pass the parameter pytree "
            "(e.g. Flax variables, an Equinox module or a dict of jnp arrays)"
        )
    return Linearized(f, leaves, static)
