"""Linearized networks whose parameters stay arguments, with a training-sized gradient.

``linearize(f, params)`` is the first-order Taylor expansion of ``f`` in its parameters
(Lee et al. 2019, "Wide neural networks of any depth evolve as linear models under
gradient descent"):

    lin(new_params, *inputs) = f(params, *inputs) + J(params, *inputs) (new_params - params)

neural-tangents' ``nt.linearize`` returns a Python closure over ``params``; under ``jit``
or ``pmap`` the closed-over arrays become constants of the compiled program, so a model's
weights are copied into the executable (8 MiB of parameters gave 16 MiB of program text;
a ViT's hundreds of MiB made loading the program fail even at batch size 1, seed 000).
Here the result is a pytree whose leaves *are* the linearization point: passed to a
jitted step it arrives as an argument, never as a constant.

Its gradient w.r.t. ``new_params`` is a ``jax.custom_vjp``: the forward pass is one
``jax.jvp`` of ``f`` (it keeps nothing but the arguments), the backward pass one
``jax.vjp`` of ``f`` at the linearization point applied to the output cotangent (J^T ct,
exact because ``lin`` is linear in ``new_params``). So a training step of the linearized
model holds what a training step of ``f`` holds, plus about two output-sized buffers,
for about one extra forward pass of compute, whatever ``f``'s jvp rules save. (For plain
JAX layers, differentiating the jvp directly with the parameters as arguments keeps
about as much; the closure over the parameters is what made seed 000 fail.) When the
linearization point or the inputs are differentiated too, the exact gradient of the jvp
is taken instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

__all__ = ["Linearized", "linearize"]


def _is_array(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


def _is_differentiable(leaf: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)


class _Static:
    """Non-array leaves (functions, ints, strings) kept out of the traced arguments.

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


def _split(tree: Any) -> tuple[list, _Static]:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    is_dynamic = tuple(_is_array(leaf) for leaf in leaves)
    dynamic = [leaf for leaf, d in zip(leaves, is_dynamic) if d]
    static = tuple(leaf for leaf, d in zip(leaves, is_dynamic) if not d)
    return dynamic, _Static(treedef, is_dynamic, static)


def _instantiate(cotangent: Any) -> Any:
    def dense(c):
        return jnp.zeros(c.shape, c.dtype) if isinstance(c, SymbolicZero) else c

    return jax.tree_util.tree_map(dense, cotangent, is_leaf=lambda c: isinstance(c, SymbolicZero))


class _Cheap(tuple):
    """Residuals when only new_params is differentiated: the linearization point and inputs."""


class _Full(tuple):
    """Residuals when the point or the inputs are differentiated too: a full vjp."""


jax.tree_util.register_pytree_node(_Cheap, lambda r: (tuple(r), None), lambda _, c: _Cheap(c))
jax.tree_util.register_pytree_node(_Full, lambda r: (tuple(r), None), lambda _, c: _Full(c))


def _make_apply(f: Callable, point: _Static, diff_mask: tuple[bool, ...], inputs: _Static):
    """The custom_vjp ``(point, new, inputs) -> lin`` over lists of array leaves."""

    def call(point_leaves, input_leaves):
        args, kwargs = inputs.rebuild(input_leaves)
        return f(point.rebuild(point_leaves), *args, **kwargs)

    def split_diff(leaves):
        return [leaf for leaf, d in zip(leaves, diff_mask) if d]

    def merge_diff(diff_leaves, leaves):
        diff = iter(diff_leaves)
        return [next(diff) if d else leaf for leaf, d in zip(leaves, diff_mask)]

    def value(point_leaves, new_leaves, input_leaves):
        def of_diff(diff_leaves):
            return call(merge_diff(diff_leaves, point_leaves), input_leaves)

        primal = split_diff(point_leaves)
        # Subtract in the parameters' own dtype: the tangent must match the primal's.
        tangent = [jnp.asarray(n, p.dtype) - p for n, p in zip(split_diff(new_leaves), primal)]
        out, out_tangent = jax.jvp(of_diff, (primal,), (tangent,))
        return jax.tree_util.tree_map(jnp.add, out, out_tangent)

    @jax.custom_vjp
    def apply(point_leaves, new_leaves, input_leaves):
        return value(point_leaves, new_leaves, input_leaves)

    def fwd(point_leaves, new_leaves, input_leaves):
        values = [[leaf.value for leaf in group] for group in (point_leaves, new_leaves, input_leaves)]
        others_perturbed = any(leaf.perturbed for leaf in point_leaves) or any(
            leaf.perturbed for leaf in input_leaves
        )
        if others_perturbed:
            out, full_vjp = jax.vjp(value, *values)
            return out, _Full((full_vjp,))
        return value(*values), _Cheap((values[0], values[2]))

    def bwd(residuals, cotangent):
        cotangent = _instantiate(cotangent)
        if isinstance(residuals, _Full):
            (full_vjp,) = residuals
            return full_vjp(cotangent)
        point_leaves, input_leaves = residuals

        def of_diff(diff_leaves):
            return call(merge_diff(diff_leaves, point_leaves), input_leaves)

        _, f_vjp = jax.vjp(of_diff, split_diff(point_leaves))
        (diff_cotangent,) = f_vjp(cotangent)
        diff = iter(diff_cotangent)
        new_cotangent = [next(diff) if d else None for d in diff_mask]
        return (
            [None] * len(point_leaves),
            new_cotangent,
            [None] * len(input_leaves),
        )

    apply.defvjp(fwd, bwd, symbolic_zeros=True)
    return apply


@jax.tree_util.register_pytree_node_class
class Linearized:
    """``f`` linearized around ``params``; a pytree whose leaves are the array leaves of
    ``params``. Call it as ``lin(new_params, *inputs, **kwargs)``.

    Attributes:
      f: the function that was linearized, ``f(params, *inputs, **kwargs)``.
      params: the linearization point (same structure as passed to :func:`linearize`).
    """

    def __init__(self, f: Callable, leaves: list, static: _Static):
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
        diff_mask = tuple(_is_differentiable(leaf) for leaf in self._leaves)
        input_leaves, input_static = _split((inputs, kwargs))
        apply = _make_apply(self.f, self._static, diff_mask, input_static)
        return apply(self._leaves, new_leaves, input_leaves)


def linearize(f: Callable, params: Any) -> Linearized:
    """The first-order Taylor expansion of ``f`` in ``params``, as a pytree.

    Args:
      f: ``f(params, *inputs, **kwargs)``, e.g. a Flax ``model.apply`` (with ``params``
        the variables dict), ``lambda model, x: model(x)`` for an Equinox module, or any
        function of a parameter pytree.
      params: the linearization point. Its array leaves become the leaves of the result;
        other leaves (functions, Python numbers) stay static.

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
    if not any(_is_differentiable(leaf) for leaf in leaves):
        raise TypeError(
            "params has no float array leaves to linearize in; pass the parameter pytree "
            "(e.g. Flax variables, an Equinox module or a dict of jnp arrays)"
        )
    return Linearized(f, leaves, static)
