"""Reversible scans: ``mw.scan(f, init, xs, inverse=g)`` with O(1) carries in the backward.

Result used: a step whose carry update has an exact inverse, ``carry = g(f(carry, x)[0],
x)``, can be reversed without storing its carries: the backward pass rebuilds each carry
from the next one and differentiates the step there. Gomez et al. (2017), "The
reversible residual network: backpropagation without storing activations", do this for
additive couplings (``y1 = x1 + F(x2)``, ``y2 = x2 + G(y1)``); Kidger et al. (2021),
"Efficient and accurate gradients for neural SDEs", for the reversible Heun method. The
gradient then keeps one carry whatever the number of steps, and evaluates the body 2n
times and ``g`` n times (``lax.scan``: n body evaluations, n steps of residuals kept).

In floating point ``g`` inverts ``f`` only up to rounding, and the error of a rebuilt
carry can grow from step to step ("drift"). Two controls:

* ``checkpoints=c`` keeps c carries evenly spaced (the final one among them): the
  backward restarts from the kept carry every ``ceil(n / c)`` steps, so the drift
  grows over at most that many steps (``c=1``, the default: one carry, no bound);
* ``drift=DriftLog()`` records, at every kept carry and at ``init``, how far the
  rebuilt carry is from the kept one, read after the gradient ran (:class:`DriftLog`).

This module holds the executor (one ``custom_vjp``, declared once below with the
:class:`ReversibleLoop` as its static argument, on the toolkit of :mod:`memwise._vjp`
and the taped step of :mod:`memwise._taped`) and the checks of ``inverse=``;
:func:`memwise.scan.scan` is the public face and calls :func:`scan` here.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from memwise._jax_private import varying_axes
from memwise._loop_inputs import (
    carry_type_error,
    check_carry_structure,
    flat_step,
    loop_body,
    resolve_checkpoints,
)
from memwise._taped import TapedStep, entry, replayed_cotangents, store, take, unwrap_loop
from memwise._vjp import (
    Static,
    closure_convert,
    custom_vjp,
    fill,
    guard_forward_mode,
    is_zero,
    select,
    unwrap,
)
from memwise.sharding import first_items, typed_zeros, vary

__all__ = ["DriftLog", "Drift", "ReversibleLoop", "scan"]

_FORWARD_MODE = (
    "memwise.scan with inverse= supports reverse mode (grad, vjp, jacrev; also "
    "jax.hessian and jacfwd of grad) and vmap, but not forward mode through the loop "
    "(jvp, jacfwd, jax.linearize); drop inverse= and use schedule='nested' for forward mode"
)
_SECOND_ORDER = (
    "memwise.scan with inverse= cannot be differentiated twice in reverse mode (grad of "
    "grad, jacrev of grad); use forward-over-reverse (jax.hessian, "
    "jax.jacfwd(jax.grad(f))), which works, or drop inverse= and use schedule='nested'"
)


class Drift(NamedTuple):
    """One comparison of a rebuilt carry with the kept one.

    Attributes:
      step: the carry compared is the one after ``step`` steps of the loop (0: ``init``).
      absolute: the largest ``|rebuilt - kept|`` over the carry's leaves.
      relative: ``absolute`` over the largest ``|kept|`` (``absolute`` itself where the
        kept carry is all zeros).
      steps_rebuilt: how many consecutive inverse steps produced the rebuilt carry.
    """

    step: int
    absolute: float
    relative: float
    steps_rebuilt: int


class DriftLog:
    """Records the drift of a reversible scan's rebuilt carries, each time its gradient runs.

    Pass one as ``mw.scan(..., inverse=g, drift=log)``. The backward pass then compares,
    at every carry it keeps (``checkpoints=``) and at ``init``, the carry it rebuilt with
    ``inverse`` with the kept one, and hands the figures to the log when the compiled
    program runs (``jax.debug.callback``: under ``jit``, ``vmap`` (once per batch
    element) and enclosing loops too). Reading the log waits for pending callbacks.
    Without ``drift=`` nothing is compared and nothing leaves the device.

    The kept carries bound the drift: the backward restarts from each, so a drift
    measured here is also the largest error of a carry the gradient was computed at.

    Each record is a ``Drift(step, absolute, relative, steps_rebuilt)``: the carry after
    ``step`` steps (0: ``init``) was rebuilt over ``steps_rebuilt`` inverse steps and
    differs from the kept one by ``absolute`` (the largest ``|rebuilt - kept|`` over the
    leaves), ``relative`` to the largest ``|kept|``. ``max_absolute``,
    ``max_relative`` and :meth:`check` summarise them; :meth:`clear` forgets them.

    Example::

        >>> import jax, jax.numpy as jnp, memwise as mw
        >>> step = lambda h, x: (h + jnp.sin(x), None)       # h -> h + sin(x) ...
        >>> unstep = lambda h, x: h - jnp.sin(x)             # ... and back
        >>> log = mw.DriftLog()
        >>> loss = lambda h0, xs: mw.scan(
        ...     step, h0, xs, inverse=unstep, drift=log)[0].sum()
        >>> _ = jax.grad(loss)(jnp.zeros(3), jnp.ones((100, 3)))
        >>> ([(d.step, d.steps_rebuilt) for d in log.records],
        ...  log.max_relative < 1e-5)
        ([(0, 100)], True)
    """

    def __init__(self) -> None:
        self._records: list[Drift] = []

    def _add(self, steps: Any, rebuilt: Any, absolute: Any, relative: Any) -> None:
        for s, k, a, r in zip(
            np.asarray(steps), np.asarray(rebuilt), np.asarray(absolute), np.asarray(relative)
        ):
            self._records.append(Drift(int(s), float(a), float(r), int(k)))

    @property
    def records(self) -> list[Drift]:
        """Every comparison so far, in the order the backward passes made them."""
        jax.effects_barrier()
        return list(self._records)

    @property
    def max_absolute(self) -> float:
        """The largest absolute drift recorded (0.0 before any gradient ran)."""
        return max((d.absolute for d in self.records), default=0.0)

    @property
    def max_relative(self) -> float:
        """The largest relative drift recorded (0.0 before any gradient ran)."""
        return max((d.relative for d in self.records), default=0.0)

    def check(self, tolerance: float) -> None:
        """Raises ``ValueError`` if a relative drift above ``tolerance`` was recorded.

        Args:
          tolerance: the largest relative drift accepted (e.g. 1e-4 in float32).

        Raises:
          ValueError: naming the step, the drift and the fix (more ``checkpoints``, or a
            wider dtype for the carry).
        """
        worst = max(self.records, key=lambda d: d.relative, default=None)
        if worst is not None and worst.relative > tolerance:
            raise ValueError(
                f"the carry rebuilt by inverse= after step {worst.step} drifted by "
                f"{worst.relative:.3g} (relative; {worst.absolute:.3g} absolute) from the "
                f"kept one over {worst.steps_rebuilt} inverse steps, above tolerance="
                f"{tolerance:g}; keep more carries (checkpoints=, the drift grows over "
                "ceil(n / checkpoints) steps) or carry the state in a wider dtype"
            )

    def clear(self) -> None:
        """Forgets the records."""
        jax.effects_barrier()
        self._records.clear()

    def __repr__(self) -> str:
        records = self.records
        return (
            f"DriftLog({len(records)} records, max_absolute={self.max_absolute:.3g}, "
            f"max_relative={self.max_relative:.3g})"
        )


@dataclasses.dataclass(frozen=True, eq=False)
class ReversibleLoop:
    """The static parts of a reversible scan (compared by identity, never by value).

    Attributes:
      body: ``(carry, x, *consts) -> (new_carry, y)`` on lists of leaves.
      inverse: ``(new_carry, x, *inverse_consts) -> carry`` on lists of leaves.
      n_steps: the loop's length (>= 1).
      spacing: a carry is kept every ``spacing`` steps (the final one always).
      reverse, unroll: as in ``lax.scan`` (the forward pass only).
      drift: where the backward pass reports its comparisons, or None.
    """

    body: Callable
    inverse: Callable
    n_steps: int
    spacing: int
    reverse: bool = False
    unroll: int | bool = 1
    drift: DriftLog | None = None

    @property
    def n_slots(self) -> int:
        """Carries kept inside the loop (not counting ``init`` and the final one)."""
        return math.ceil(self.n_steps / self.spacing) - 1

    def step(self, carry: list, x: list, consts: list) -> tuple[list, list]:
        return self.body(carry, x, *consts)

    def time_index(self, i: Any) -> Any:
        """The position in ``xs``/``ys`` of the step run i-th."""
        return self.n_steps - 1 - i if self.reverse else i


# --------------------------------------------------------------------------------------
# the public path: checks, then the executor


def check_inverse(inverse: Any, drift: Any, schedule: str, checkpoints: Any) -> None:
    """Up-front checks of ``inverse=`` and ``drift=`` (before anything is traced)."""
    if inverse is None:
        raise ValueError(
            "drift= records how far the carries rebuilt by inverse= drift; pass "
            "inverse=(next_carry, x) -> carry, or drop drift="
        )
    if not callable(inverse):
        raise TypeError(
            f"inverse must be callable, (next_carry, x) -> carry (the carry before the "
            f"step), got {type(inverse).__name__}"
        )
    if drift is not None and not isinstance(drift, DriftLog):
        raise TypeError(f"drift must be None or a memwise.DriftLog(), got {type(drift).__name__}")
    if schedule != "binomial":
        raise ValueError(
            f"schedule={schedule!r} does not apply with inverse=: a reversible scan rebuilds "
            "its carries instead of following a checkpoint schedule; drop schedule= (or "
            "inverse=, to use that schedule)"
        )
    if checkpoints == "auto":
        raise ValueError(
            "checkpoints='auto' does not apply with inverse=: the gradient's memory is "
            "constant in the length; checkpoints=c keeps c carries only to bound the "
            "drift (pass an int, or None for one)"
        )


def _check_inverse_output(inverse: Callable, init: Any, x_example: Any) -> None:
    out = jax.eval_shape(inverse, init, x_example)
    check_carry_structure(
        init,
        out,
        lambda in_def, out_def: (
            f"inverse must return the carry before the step, structured as init ({in_def}), "
            f"but returned {out_def}; return only the carry (not a (carry, y) pair)"
        ),
    )
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(init)[0]]
    for path, a, b in zip(paths, jax.tree_util.tree_leaves(init), jax.tree_util.tree_leaves(out)):
        if a.shape != b.shape or a.dtype != b.dtype:
            raise carry_type_error("inverse", path, a, b)


def scan(
    f: Callable,
    inverse: Any,
    init: Any,
    xs: Any,
    n: int,
    read_only: list,
    drift: Any,
    schedule: str,
    checkpoints: Any,
    reverse: bool,
    unroll: Any,
) -> tuple[Any, Any]:
    """``memwise.scan(f, init, xs, inverse=inverse, ...)`` once the common checks passed
    (``init`` with its weak types resolved, ``read_only`` from ``scan``'s carry check)."""
    check_inverse(inverse, drift, schedule, checkpoints)
    _check_inverse_output(inverse, init, first_items(xs))
    if n == 0:
        if checkpoints is not None:
            resolve_checkpoints(checkpoints, 1)
        return lax.scan(f, init, xs, length=0, reverse=reverse)
    c = 1 if checkpoints is None else resolve_checkpoints(checkpoints, n)
    carry_leaves, carry_def = jax.tree_util.tree_flatten(init)
    x_leaves, x_def = jax.tree_util.tree_flatten(xs)
    y_def_box: list = []
    flat = flat_step(f, carry_def, x_def, y_def_box)
    body, consts, loop_carry, x_leaves = loop_body(flat, carry_leaves, x_leaves, read_only)
    moving = [not r for r in read_only]

    def flat_inverse(loop_carry, x):
        full = jax.tree_util.tree_unflatten(carry_def, fill(carry_leaves, moving, loop_carry))
        previous = inverse(full, jax.tree_util.tree_unflatten(x_def, x))
        leaves = select(jax.tree_util.tree_leaves(previous), moving)
        return [vary(a, varying_axes(c)) for a, c in zip(leaves, loop_carry)]

    inverse_body, inverse_consts = closure_convert(flat_inverse, loop_carry, first_items(x_leaves))
    # The inverse only rebuilds values: its closed-over arrays get no cotangent.
    inverse_consts = [lax.stop_gradient(a) for a in inverse_consts]
    loop = ReversibleLoop(
        body=body,
        inverse=inverse_body,
        n_steps=n,
        spacing=math.ceil(n / c),
        reverse=reverse,
        unroll=unroll,
        drift=drift,
    )
    carry_out, ys = run(loop, consts, inverse_consts, loop_carry, x_leaves)
    carry_out = fill(carry_leaves, moving, carry_out)
    return (
        jax.tree_util.tree_unflatten(carry_def, carry_out),
        jax.tree_util.tree_unflatten(y_def_box[0], ys),
    )


def run(
    loop: ReversibleLoop, consts: list, inverse_consts: list, carry: list, xs: list
) -> tuple[list, list]:
    """``(final carry, ys)`` of ``loop``; its reverse mode rebuilds carries with the inverse."""

    def guard(leaves):
        return guard_forward_mode(leaves, _FORWARD_MODE)

    return _run(loop, guard(consts), inverse_consts, guard(carry), guard(xs))


# --------------------------------------------------------------------------------------
# the custom VJP


@functools.partial(custom_vjp, nondiff_argnums=(0,), forward_mode_error=lambda _: _FORWARD_MODE)
def _run(loop, consts, inverse_consts, carry, xs):
    carry, ys, _ = _sweep(loop, consts, carry, xs, record=False)
    return carry, ys


def _run_fwd(loop, consts, inverse_consts, carry, xs):
    consts, init, xs, perturbed = unwrap_loop(loop, consts, carry, xs)
    inverse_consts, _ = unwrap(inverse_consts)
    final, ys, kept = _sweep(loop, consts, init, xs, record=True)
    return (final, ys), (consts, inverse_consts, init, final, xs, kept, Static(perturbed))


def _run_bwd(loop, residuals, output_cotangents):
    consts, inverse_consts, init, final, xs, kept, perturbed = residuals
    consts_perturbed, carry_perturbed, carry_mask, xs_perturbed = perturbed.value
    ct_carry, ct_ys = output_cotangents
    n, spacing = loop.n_steps, loop.spacing
    taped = TapedStep(loop, final, entry(xs), consts, carry_mask, xs_perturbed, consts_perturbed)
    ct_carry = [
        typed_zeros([c])[0] if is_zero(ct) else ct
        for ct, c in zip(select(ct_carry, carry_mask), select(final, carry_mask))
    ]
    ct_ys = [None if is_zero(ct) else ct for ct in ct_ys]
    ct_consts = typed_zeros(select(consts, taped.const_mask))
    ct_xs = typed_zeros(select(xs, taped.x_mask))
    n_checks = loop.n_slots + 1  # the kept carries and init
    drift = (jnp.zeros(n_checks, jnp.float32), jnp.zeros(n_checks, jnp.float32))

    def reverse_step(j, state):
        next_carry, ct_carry, ct_consts, ct_xs, drift = state
        i = n - 1 - j
        t = loop.time_index(i)
        x = take(xs, t)
        carry = loop.inverse(next_carry, x, *inverse_consts)
        # The carry before step i is kept when i is a multiple of the spacing: restart
        # from it, so that the drift never grows over more than `spacing` steps.
        at_kept = i % spacing == 0
        if loop.n_slots:
            slot = jnp.maximum(i // spacing - 1, 0)
            stored = [jnp.where(i == 0, a, b) for a, b in zip(init, take(kept, slot))]
        else:
            stored = list(init)
        if loop.drift is not None:
            drift = _compare(drift, carry, stored, at_kept, i // spacing)
        carry = [jnp.where(at_kept, s, c) for s, c in zip(stored, carry)]
        ct_y = [None if ct is None else take([ct], t)[0] for ct in ct_ys]
        ct_c, ct_x, ct_k = taped(carry, x, consts, ct_carry, ct_y)
        ct_consts = [a + b for a, b in zip(ct_consts, ct_k)]
        ct_xs = [lax.dynamic_update_index_in_dim(a, b, t, 0) for a, b in zip(ct_xs, ct_x)]
        return carry, ct_c, ct_consts, ct_xs, drift

    _, ct_carry, ct_consts, ct_xs, drift = lax.fori_loop(
        0, n, reverse_step, (list(final), ct_carry, ct_consts, ct_xs, drift)
    )
    if loop.drift is not None:
        steps = np.arange(n_checks) * spacing
        rebuilt = np.minimum(spacing, n - steps)
        jax.debug.callback(loop.drift._add, steps, rebuilt, *drift)

    out = functools.partial(replayed_cotangents, error=_SECOND_ORDER)
    init_mask = [m and p for m, p in zip(carry_mask, carry_perturbed)]
    return (
        out(taped.const_mask, ct_consts),
        [None] * len(inverse_consts),
        out(init_mask, select(ct_carry, select(carry_perturbed, carry_mask))),
        out(taped.x_mask, ct_xs),
    )


_run.defvjp(_run_fwd, _run_bwd)


def _compare(drift: tuple, rebuilt: list, stored: list, at_kept: Any, index: Any) -> tuple:
    """``drift`` (absolute, relative arrays) with entry ``index`` set when ``at_kept``."""
    absolute = jnp.float32(0.0)
    scale = jnp.float32(0.0)
    for r, s in zip(rebuilt, stored):
        if r.size == 0:
            continue
        # the difference in the carry's own precision (a float64 drift of 1e-16 would
        # vanish in float32 arithmetic), at least float32; the figures as float32
        wide = jnp.promote_types(r.dtype, jnp.float32)
        difference = jnp.max(jnp.abs(r.astype(wide) - s.astype(wide))).astype(jnp.float32)
        absolute = jnp.maximum(absolute, difference)
        scale = jnp.maximum(scale, jnp.max(jnp.abs(s)).astype(jnp.float32))
    relative = jnp.where(scale > 0, absolute / jnp.where(scale > 0, scale, 1.0), absolute)
    index = jnp.minimum(index, drift[0].shape[0] - 1)
    return tuple(
        jnp.where(at_kept, d.at[index].set(v), d) for d, v in zip(drift, (absolute, relative))
    )


# --------------------------------------------------------------------------------------
# forward: run the steps, keeping every `spacing`-th carry


def _sweep(
    loop: ReversibleLoop, consts: list, carry: list, xs: list, *, record: bool
) -> tuple[list, Any, list]:
    """Runs the loop: ``(final carry, ys, kept)``; with ``record``, ``kept[k]`` holds the
    carry after ``(k + 1) * spacing`` steps."""
    record = record and loop.n_slots > 0
    kept = (
        [
            vary(jnp.zeros((loop.n_slots,) + jnp.shape(a), jnp.result_type(a)), varying_axes(a))
            for a in carry
        ]
        if record
        else []
    )

    def scan_body(state, x):
        i, carry, kept = state
        if record:
            slot = jnp.maximum(i // loop.spacing - 1, 0)
            kept = store(kept, carry, slot, (i > 0) & (i % loop.spacing == 0))
        carry, y = loop.step(carry, x, consts)
        return (i + 1, carry, kept), y

    (_, carry, kept), ys = lax.scan(
        scan_body,
        (jnp.int32(0), carry, kept),
        xs,
        length=loop.n_steps,
        reverse=loop.reverse,
        unroll=loop.unroll,
    )
    return carry, ys, kept
