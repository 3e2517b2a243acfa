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

``taylor_expand(f, params, degree)`` is the Taylor polynomial of any degree (neural-tangents'
``nt.taylor_expand``; the second-order expansion of Dyer & Gur-Ari 2020 and Huang & Yau
2020, "Dynamics of deep neural networks and neural tangent hierarchy", describes wide
networks beyond the linear regime): ``sum_k D^k f(params)[new - params]^k / k!``, each
derivative a nested ``jax.jvp``. It is the same kind of pytree, so its expansion point is
an argument of the compiled program too; its gradient is plain reverse mode through the
nested jvps (the polynomial is not linear in the new parameters).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from memwise._arguments import non_negative_int
from memwise._vjp import (
    Static,
    closure_convert,
    cotangents,
    custom_vjp,
    dense,
    fill,
    is_differentiable,
    select,
    unwrap,
)

__all__ = ["Linearized", "TaylorExpanded", "linearize", "taylor_expand"]


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


def _convert(
    f: Callable, point: _Skeleton, point_leaves: list, inputs: _Skeleton, input_leaves: list
) -> tuple[Callable, list]:
    """``f`` as a function of (point leaves, operands) and its closed-over arrays
    (:func:`memwise._vjp.closure_convert`, as every memwise custom VJP does)."""

    def flat(point_leaves, input_leaves):
        args, kwargs = inputs.rebuild(input_leaves)
        return f(point.rebuild(point_leaves), *args, **kwargs)

    converted, consts = closure_convert(flat, point_leaves, input_leaves)
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


def _value(spec: _Apply, point_leaves: list, new_leaves: list, operands: Any) -> Any:
    primal = select(point_leaves, spec.diff_mask)
    # Subtract in the parameters' own dtype: the tangent must match the primal's.
    tangent = [
        jnp.asarray(n, p.dtype) - p for n, p in zip(select(new_leaves, spec.diff_mask), primal)
    ]
    out, out_tangent = jax.jvp(spec.of_point(point_leaves, operands), (primal,), (tangent,))
    return jax.tree_util.tree_map(jnp.add, out, out_tangent)


def _check_new_params(point: _Skeleton, point_leaves: list, new_params: Any) -> list:
    """The array leaves of ``new_params``, checked against the expansion point's."""
    new_leaves, new_static = _split(new_params)
    if new_static.treedef == point.treedef and new_static.is_dynamic != point.is_dynamic:
        paths = [
            jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(new_params)[0]
        ]
        for path, was, now, leaf in zip(
            paths, point.is_dynamic, new_static.is_dynamic, jax.tree.leaves(new_params)
        ):
            if was and not now:
                raise TypeError(
                    f"new_params{path} is {leaf!r} (a {type(leaf).__name__}) where the "
                    "linearization point has an array; pass an array, e.g. "
                    f"jnp.asarray({leaf!r}, dtype)"
                )
            if now and not was:
                raise TypeError(
                    f"new_params{path} is an array where the linearization point has a "
                    "non-array leaf (a Python number or object: a static part of the "
                    "point); linearize at a point whose leaf is an array to vary it"
                )
    if new_static.treedef != point.treedef or new_static.is_dynamic != point.is_dynamic:
        raise ValueError(
            "new_params must have the structure of the linearization point: expected "
            f"{point.treedef}, got {new_static.treedef}"
        )
    for old, new in zip(point_leaves, new_leaves):
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
    for path, old, new in zip(static_paths, point.static_leaves, new_static.static_leaves):
        if not _same_static(old, new):
            raise ValueError(
                f"new_params{path} is {new!r} where the linearization point has "
                f"{old!r}: non-array leaves (Python numbers, functions) are static parts "
                "of the linearization point and cannot change. Linearize again at the "
                "new point, or make the leaf an array to linearize in it too."
            )
    return new_leaves


@functools.partial(custom_vjp, nondiff_argnums=(0,))
def _apply(spec: _Apply, point_leaves: list, new_leaves: list, operands: Any) -> Any:
    return _value(spec, point_leaves, new_leaves, operands)


def _apply_fwd(spec, point_leaves, new_leaves, operands):
    (point_leaves, point_flags), (new_leaves, _), (operands, operand_flags) = (
        unwrap(group) for group in (point_leaves, new_leaves, operands)
    )
    if any(point_flags) or any(operand_flags):
        # The point, the inputs or arrays f closes over are differentiated too: the
        # exact vjp of the jvp.
        out, full_vjp = jax.vjp(functools.partial(_value, spec), point_leaves, new_leaves, operands)
        return out, (Static(True), full_vjp)
    return _value(spec, point_leaves, new_leaves, operands), (
        Static(False),
        (point_leaves, operands),
    )


def _apply_bwd(spec, residuals, cotangent):
    full, data = residuals
    cotangent = dense(cotangent)
    if full.value:
        return data(cotangent)
    point_leaves, operands = data
    # lin is linear in new_params: its vjp is J^T ct at the linearization point.
    _, f_vjp = jax.vjp(spec.of_point(point_leaves, operands), select(point_leaves, spec.diff_mask))
    (diff_cotangent,) = f_vjp(cotangent)
    return (
        [None] * len(point_leaves),
        cotangents(spec.diff_mask, diff_cotangent),
        [None] * len(operands),
    )


_apply.defvjp(_apply_fwd, _apply_bwd)


@jax.tree_util.register_pytree_node_class
class Linearized:
    """``f`` linearized around ``params``; a pytree whose leaves are the array leaves of
    ``params``. Call it as ``lin(new_params, *inputs, **kwargs)``.

    Attributes:
      f: the function that was linearized, ``f(params, *inputs, **kwargs)``.
      params: the linearization point (same structure as passed to :func:`linearize`).

    Example::

        >>> import jax, jax.numpy as jnp, memwise as mw
        >>> lin = mw.linearize(lambda p, x: jnp.sin(p) * x, jnp.zeros(()))
        >>> lin
        Linearized(<lambda>, 1 parameter arrays)
        >>> float(lin(jnp.float32(0.5), 2.0))  # sin(0) x + cos(0) x (0.5 - 0)
        1.0
        >>> # the expansion point is a leaf, not a baked-in constant
        >>> jax.tree.leaves(lin)
        [Array(0., dtype=float32)]
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
        new_leaves = _check_new_params(self._static, self._leaves, new_params)
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
        >>> jax.tree.map(jnp.shape, grads)
        {'v': (4, 2), 'w': (3, 4)}
    """
    if not callable(f):
        raise TypeError(f"f must be callable f(params, *inputs), got {type(f).__name__}")
    leaves, static = _split(params)
    if not any(is_differentiable(leaf) for leaf in leaves):
        raise TypeError(
            "params has no float array leaves to linearize in; pass the parameter pytree "
            "(e.g. Flax variables, an Equinox module or a dict of jnp arrays). Python "
            "numbers are static parts of the point: wrap one in jnp.asarray to linearize "
            "in it"
        )
    return Linearized(f, leaves, static)


def _taylor_terms(g: Callable, primal: list, tangent: list, degree: int) -> list:
    """``[g(p), Dg(p)[t], ..., D^degree g(p)[t, ..., t]]`` by nested ``jax.jvp``.

    The jvp of the list of the first k terms gives the k+1-th as the tangent of the last
    one (the tangents of the others are unused, dead code for XLA). One nest computes
    every term, where neural-tangents' recursion re-evaluates each lower order. Nested
    forward mode still carries up to 2^k tangent streams at order k (XLA merges the
    identical ones it finds); ``jax.experimental.jet`` would be the Taylor-mode
    alternative, for fewer primitives.
    """

    def up_to(k):
        if k == 0:
            return lambda p: [g(p)]
        lower = up_to(k - 1)

        def terms(p):
            values, derivatives = jax.jvp(lower, (p,), (tangent,))
            return values + [derivatives[-1]]

        return terms

    return up_to(degree)(primal)


@jax.tree_util.register_pytree_node_class
class TaylorExpanded:
    """``f`` Taylor-expanded to ``degree`` around ``params``; a pytree whose leaves are the
    array leaves of ``params``. Call it as ``tayl(new_params, *inputs, **kwargs)``.

    Attributes:
      f: the function that was expanded, ``f(params, *inputs, **kwargs)``.
      params: the expansion point (same structure as passed to :func:`taylor_expand`).
      degree: the degree of the polynomial.

    Example::

        >>> import jax.numpy as jnp, memwise as mw
        >>> tayl = mw.taylor_expand(lambda p, x: jnp.cos(p) * x, jnp.zeros(()), 2)
        >>> tayl
        TaylorExpanded(<lambda>, degree 2, 1 parameter arrays)
        >>> float(tayl(jnp.float32(0.5), 2.0))  # (1 - 0.5**2 / 2) x
        1.75
    """

    def __init__(self, f: Callable, leaves: list, static: _Skeleton, degree: int):
        self.f = f
        self._leaves = list(leaves)
        self._static = static
        self.degree = degree

    @property
    def params(self) -> Any:
        return self._static.rebuild(self._leaves)

    def tree_flatten(self):
        return (self._leaves,), (self.f, self._static, self.degree)

    @classmethod
    def tree_unflatten(cls, aux, children):
        f, static, degree = aux
        (leaves,) = children
        return cls(f, leaves, static, degree)

    def __repr__(self) -> str:
        name = getattr(self.f, "__name__", type(self.f).__name__)
        return f"TaylorExpanded({name}, degree {self.degree}, {len(self._leaves)} parameter arrays)"

    def __call__(self, new_params: Any, *inputs: Any, **kwargs: Any) -> Any:
        new_leaves = _check_new_params(self._static, self._leaves, new_params)
        diff_mask = tuple(is_differentiable(leaf) for leaf in self._leaves)
        point = self._leaves
        primal = select(point, diff_mask)
        # The tangent in the parameters' own dtype, as the jvp requires.
        tangent = [
            jnp.asarray(n, p.dtype) - p for n, p in zip(select(new_leaves, diff_mask), primal)
        ]

        def g(diff_leaves):
            return self.f(
                self._static.rebuild(fill(point, diff_mask, diff_leaves)), *inputs, **kwargs
            )

        terms = _taylor_terms(g, primal, tangent, self.degree)
        total = terms[0]
        for order, term in enumerate(terms[1:], start=1):
            scale = 1.0 / math.factorial(order)
            total = jax.tree_util.tree_map(
                lambda a, b, scale=scale: a + (b * scale).astype(b.dtype), total, term
            )
        return total


def taylor_expand(f: Callable, params: Any, degree: int) -> TaylorExpanded:
    """The Taylor polynomial of ``f`` in ``params`` of degree ``degree``, as a pytree.

    neural-tangents' ``nt.taylor_expand`` with the design of :func:`linearize`: the
    expansion point is the result's leaves, so it reaches a jitted step as an argument,
    never as constants baked into the program.

    Args:
      f: ``f(params, *inputs, **kwargs)``, any function of a parameter pytree (a Flax
        ``model.apply``, ``lambda model, x: model(x)`` for an Equinox module).
      params: the expansion point; its array leaves become the result's leaves, other
        leaves stay static (a ValueError names one that changed in ``new_params``).
      degree: an int >= 0 (0: the constant ``f(params)``; 1: :func:`linearize`'s value).

    Returns:
      A :class:`TaylorExpanded` ``tayl`` with ``tayl(new_params, *inputs, **kwargs) =
      sum_{k <= degree} D^k f(params)[new_params - params]^k / k!``.

    Memory and compute: all terms come from one nest of ``degree`` ``jax.jvp``s of
    ``f`` (work up to about 2^degree forward passes), and ``jax.grad`` w.r.t.
    ``new_params`` is plain reverse mode through the nest, keeping its tangents too: use
    small degrees (2 or 3). The program does not grow with the parameters (they are
    arguments). Forward mode works too (no custom rule). For ``degree=1`` prefer
    :func:`linearize`, whose gradient keeps only what training ``f`` keeps.

    Example::

        >>> import jax, jax.numpy as jnp, memwise as mw
        >>> def f(params, x):
        ...     return jnp.tanh(x @ params["w"]) @ params["v"]
        >>> params = {"w": jnp.ones((3, 4)) / 3, "v": jnp.ones((4, 2))}
        >>> tayl = mw.taylor_expand(f, params, 2)
        >>> x = jnp.ones((5, 3))
        >>> bool(jnp.allclose(tayl(params, x), f(params, x)))
        True
        >>> loss = lambda p, tayl, x: jnp.sum(tayl(p, x) ** 2)
        >>> grads = jax.jit(jax.grad(loss))(params, tayl, x)  # tayl is an argument
        >>> jax.tree.map(jnp.shape, grads)
        {'v': (4, 2), 'w': (3, 4)}
    """
    if not callable(f):
        raise TypeError(f"f must be callable f(params, *inputs), got {type(f).__name__}")
    non_negative_int(degree, "degree", accepts=" (the order of the Taylor polynomial)")
    leaves, static = _split(params)
    if not any(is_differentiable(leaf) for leaf in leaves):
        raise TypeError(
            "params has no float array leaves to expand in; pass the parameter pytree "
            "(e.g. Flax variables, an Equinox module or a dict of jnp arrays). Python "
            "numbers are static parts of the point: wrap one in jnp.asarray to expand "
            "in it"
        )
    return TaylorExpanded(f, leaves, static, int(degree))
