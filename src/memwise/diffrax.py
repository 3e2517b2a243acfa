"""A Diffrax adjoint that runs ``diffeqsolve``'s step loop through ``memwise.while_loop``.

Diffrax differentiates a solve by default with ``RecursiveCheckpointAdjoint``, which
drives Equinox's checkpointed while loop (online checkpointing after Stumm & Walther
2010, "New algorithms for optimal online checkpointing", with the solution saved at
``SaveAt(ts=...)`` and the dense output in write-only buffers). :class:`CheckpointAdjoint`
takes its place: the same solve (Diffrax's own step loop, its ``loop`` with the
``inner_while_loop``/``outer_while_loop`` hooks every adjoint fills in), with both loops
run by :func:`memwise.while_loop`, its online placement and its revolve reversal of
each stretch (Griewank & Walther 2000), and the same buffers, never checkpointed. At
equal checkpoints the gradient evaluates the vector field fewer times than Equinox's
loop (``benchmarks/diffrax_adjoint.py``); the results are the same.

Diffrax's body writes its buffers through ``equinox.internal.buffer_at_set``, which
recognises Equinox's own buffer class only; the write-only views of
:mod:`memwise._buffers` are handed to it wrapped in a subclass of that class
(:class:`_EquinoxView`), whose one write method forwards to the view. That private
Equinox class is the one fragile dependency here, checked at import.

Import this module explicitly (``import memwise.diffrax``); it needs ``diffrax``
(``pip install memwise[diffrax]``).
"""

from __future__ import annotations

import functools
import math
from typing import Any

try:
    import diffrax
    import equinox.internal as eqxi
    from equinox.internal._loop.common import _Buffer as _EquinoxBuffer
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"memwise.diffrax needs diffrax and equinox ({error}); install them with "
        "`pip install memwise[diffrax]`"
    ) from error

import jax

from memwise._buffers import WriteOnlyBuffer
from memwise._loop_inputs import checkpoint_count
from memwise._while import checked_while_loop

__all__ = ["CheckpointAdjoint"]

_NOT_DIFFERENTIABLE = (
    "Cannot reverse-mode differentiate diffeqsolve(..., max_steps=None, "
    "adjoint=memwise.diffrax.CheckpointAdjoint(checkpoints=None)): an unbounded loop needs "
    "a number of checkpoints. Pass max_steps= to diffeqsolve, or "
    "CheckpointAdjoint(checkpoints=<int>)"
)


_FORWARD_MODE = (
    "adjoint=memwise.diffrax.CheckpointAdjoint() differentiates diffeqsolve in reverse "
    "mode (grad, vjp, jacrev; also jax.hessian and jacfwd of grad), not in forward mode "
    "(jvp, jacfwd, jax.linearize), like RecursiveCheckpointAdjoint; use "
    "adjoint=diffrax.ForwardMode() for forward mode"
)


class CheckpointAdjoint(diffrax.AbstractAdjoint):
    """Differentiate ``diffrax.diffeqsolve`` through the solver with memwise's loop.

    A drop-in for ``diffrax.RecursiveCheckpointAdjoint``: the same argument and results;
    the gradient follows :func:`memwise.while_loop`'s online schedule, which at equal
    checkpoints evaluates the vector field fewer times. The saved solution
    (``SaveAt(ts=...)``, ``SaveAt(steps=True)``) and the dense output are write-only
    buffers of the loop, never part of a checkpoint.

    Attributes:
      checkpoints: carries kept for the backward pass: an int >= 1, or ``None``
        (default): with ``diffeqsolve(max_steps=...)`` the count
        ``RecursiveCheckpointAdjoint`` takes then (about ``sqrt(2 max_steps)``, the
        fewest with no more than one extra forward pass when the solve runs
        ``max_steps`` steps), so that swapping the adjoint keeps the memory;
        ``"auto"`` or ``"all"`` as in :func:`memwise.while_loop` (``max_steps`` needed).
        With ``max_steps=None`` an int is needed to differentiate; ``None`` then solves
        without a gradient, as ``RecursiveCheckpointAdjoint`` does.

    Raises:
      ValueError: ``checkpoints`` < 1, or ``UnsafeBrownianPath`` (as Diffrax's adjoint).
      TypeError: ``checkpoints`` of another type; forward mode (``jax.jvp``) through the
        solve, as ``RecursiveCheckpointAdjoint`` (use ``diffrax.ForwardMode``).

    Example::

        >>> import diffrax, jax, jax.numpy as jnp
        >>> import memwise.diffrax
        >>> def final_y(y0, adjoint):
        ...     term = diffrax.ODETerm(lambda t, y, args: -y)
        ...     sol = diffrax.diffeqsolve(term, diffrax.Dopri5(), 0.0, 1.0, 0.1, y0,
        ...                               adjoint=adjoint, max_steps=64)
        ...     return sol.ys[-1]
        >>> g = jax.grad(final_y)(
        ...     1.0, memwise.diffrax.CheckpointAdjoint(checkpoints=4))
        >>> g_ref = jax.grad(final_y)(
        ...     1.0, diffrax.RecursiveCheckpointAdjoint(checkpoints=4))
        >>> bool(jnp.allclose(g, g_ref)), round(float(g), 4)  # d/dy0 of y0 exp(-1)
        (True, 0.3679)
    """

    checkpoints: int | str | None = None

    def __check_init__(self) -> None:
        c = self.checkpoints
        if c is None or c in ("auto", "all"):
            return
        checkpoint_count(c)

    def loop(
        self,
        *,
        terms: Any,
        saveat: Any,
        init_state: Any,
        max_steps: int | None,
        throw: bool,
        passed_solver_state: bool,
        passed_controller_state: bool,
        **kwargs: Any,
    ) -> Any:
        """Diffrax's solve loop with memwise's while loops (called by ``diffeqsolve``)."""
        del throw, passed_solver_state, passed_controller_state
        if diffrax._heuristics.is_unsafe_sde(terms):
            raise ValueError(
                "adjoint=memwise.diffrax.CheckpointAdjoint() does not support "
                "UnsafeBrownianPath (as RecursiveCheckpointAdjoint); use a "
                "VirtualBrownianTree, or adjoint=diffrax.ForwardMode()"
            )
        checkpoints = self.checkpoints
        if checkpoints is None and max_steps is None:
            # Nothing bounds the memory: solve without a gradient, as Diffrax does.
            lax_loop = functools.partial(eqxi.while_loop, kind="lax")
            final_state = self._loop(
                terms=terms,
                saveat=saveat,
                init_state=init_state,
                max_steps=max_steps,
                inner_while_loop=lax_loop,
                outer_while_loop=lax_loop,
                **kwargs,
            )
            return eqxi.nondifferentiable_backward(
                final_state, msg=_NOT_DIFFERENTIABLE, symbolic=True
            )
        if checkpoints is None:
            assert max_steps is not None  # the unbounded case returned above
            checkpoints = _equinox_default(max_steps)
        return self._loop(
            terms=terms,
            saveat=saveat,
            init_state=init_state,
            max_steps=max_steps,
            inner_while_loop=_save_loop,
            outer_while_loop=functools.partial(_memwise_loop, checkpoints=checkpoints),
            **kwargs,
        )


def _equinox_default(max_steps: int) -> int:
    """``checkpoints=None`` of Equinox's checkpointed loop: the fewest c with
    (c+1)(c+2)/2 > max_steps, so the same memory as ``RecursiveCheckpointAdjoint()``."""
    if max_steps == 1:
        return 1
    return math.floor(-1.5 + math.sqrt(2 * max_steps + 0.25)) + 1


# --------------------------------------------------------------------------------------
# the while loops Diffrax's solve calls, on memwise


# Diffrax's loop over the save times that fall in one step asks for a checkpoint per save
# time; it runs a handful of (cheap, vector-field-free) interpolations per step, so two
# checkpoints reverse it with little recomputation and keep memory independent of
# len(SaveAt.ts) (four cost 128 bytes more at the benchmark's 1,102 steps, 50 save times,
# and no fewer vector-field evaluations).
_SAVE_LOOP_CHECKPOINTS = 2


def _save_loop(
    cond_fun: Any, body_fun: Any, init_val: Any, *, checkpoints: Any, **kwargs: Any
) -> Any:
    """The loop over one step's save times: :func:`_memwise_loop` with few checkpoints."""
    return _memwise_loop(
        cond_fun, body_fun, init_val, checkpoints=min(checkpoints, _SAVE_LOOP_CHECKPOINTS), **kwargs
    )


def _memwise_loop(
    cond_fun: Any,
    body_fun: Any,
    init_val: Any,
    *,
    max_steps: int | None,
    buffers: Any,
    checkpoints: Any,
) -> Any:
    """``equinox.internal.while_loop(kind="checkpointed")``'s call, run by memwise.

    Diffrax's functions see Equinox-style buffers (:class:`_EquinoxView`); the loop sees
    memwise's write-only views inside them. Used for both of Diffrax's loops: the step
    loop, and the loop over the save times within one step (nested, writing the step
    loop's buffers).
    """
    if max_steps == 0:
        return init_val

    def cond(val):
        return cond_fun(_to_equinox(val))

    def body(val):
        return _from_equinox(body_fun(_to_equinox(val)))

    out = checked_while_loop(
        cond,
        body,
        _from_equinox(init_val),
        max_steps=max_steps,
        checkpoints=checkpoints,
        buffers=buffers,
        forward_mode_error=_FORWARD_MODE,
        # Diffrax writes each index of its buffers once (a save time's, an accepted
        # step's), the contract of Equinox's buffers: their cotangents are only read.
        writes_once=True,
    )
    return _to_equinox(out)


def _to_equinox(tree: Any) -> Any:
    return jax.tree_util.tree_map(
        lambda leaf: (
            _EquinoxView(leaf, True, None, False)  # type: ignore[arg-type]  # pred: True, always
            if isinstance(leaf, WriteOnlyBuffer)
            else leaf
        ),
        tree,
    )


def _from_equinox(tree: Any) -> Any:
    return jax.tree_util.tree_map(
        lambda node: node._array if isinstance(node, _EquinoxView) else node,
        tree,
        is_leaf=lambda node: isinstance(node, _EquinoxView),
    )


class _EquinoxView(_EquinoxBuffer):
    """A memwise write-only view in the guise of Equinox's buffer, for Diffrax's writes.

    Why: ``equinox.internal.buffer_at_set(buffer, i, x, pred=...)``, which Diffrax's step
    calls for ``SaveAt(steps=True)`` and the dense output, treats anything but Equinox's
    private ``_Buffer`` as an array and reads it. This subclass keeps Equinox's
    ``.at[i].set(x, pred=...)`` path and forwards the one write to the memwise view
    (``_array``), which checks it; reads (``buffer[i]``) reach the view and raise.
    """

    def _op(
        self, pred: Any, item: Any, x: Any, op: Any, kwargs: Any, makes_false_steps: Any
    ) -> Any:
        del op, makes_false_steps
        if kwargs:
            raise TypeError(
                f"memwise's loop buffers take buffer.at[i].set(value, pred=...) only, got "
                f"the options {sorted(kwargs)}"
            )
        view = self._array.at[item].set(x, pred=None if pred is True else pred)
        return _EquinoxView(view, self._pred, self._tag, self._makes_false_steps)
