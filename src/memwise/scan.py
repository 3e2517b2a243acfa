"""``scan`` whose reverse mode keeps O(checkpoints) carries, not O(n).

``jax.lax.scan`` under ``jax.grad`` stores every step's residuals; wrapping the body in
``jax.checkpoint`` still stores one carry per step (a Flax LSTM over 10,000 steps keeps
10,000 carries). Chen et al. (2016) reach O(sqrt n) memory by replaying segments; the
optimal way to do it for a loop of known length is the binomial ("revolve") schedule of
Griewank & Walther (2000), decided in :mod:`memwise.schedule` and executed by
:mod:`memwise._binomial`: the forward pass writes the scheduled carries into a stacked
``(n_slots, ...)`` buffer, the backward pass (:mod:`memwise._revolve`, the one
``while_loop`` runs too) restores the newest stored carry, replays to the step to
reverse storing at revolve's splits, computed on the device, and differentiates it. The
schedule enters as O(c) integers, so the compiled program, its constants and its
compile time do not depend on n.

This module is the public face: it checks the inputs, resolves ``checkpoints``, makes
the arrays the body closes over explicit (:func:`memwise._vjp.closure_convert`) so that they
receive gradients, and offers the transformation-transparent alternatives (``schedule="nested"``,
``"per_step"``, ``"none"``). ``xs`` are read by index (never copied into checkpoints) and
``ys`` are written once by the forward pass.

Trade-offs, honestly:

* ``schedule="binomial"`` is a ``custom_vjp``: reverse mode (``grad``, ``vjp``,
  ``jacrev``), ``vmap`` and forward-over-reverse (``jax.hessian``, ``jacfwd(grad)``)
  work; forward mode through the loop (``jvp``, ``jacfwd``, ``jax.linearize``) raises a
  ``TypeError`` naming ``schedule="nested"`` (nested ``lax.scan`` + ``jax.checkpoint``:
  any transformation, ~``levels * n**(1/levels)`` carries, ``levels * n`` evaluations),
  with or without ``jit``; so does reverse-over-reverse (``grad`` of ``grad``), whose
  inner backward pass replays the loop in a ``lax.while_loop``.
* Like ``lax.scan``, only the carry leaves that the differentiated inputs perturb are
  differentiated, and a carry leaf the body returns unchanged is a loop constant (no
  checkpoint slot; unbatched under ``vmap`` if its initial value is). Inside
  ``shard_map`` the carry and xs are cast to vary like the loop's inputs, and a
  replicated closed-over array's cotangent is all-reduced once, after the backward loop
  (its casts inside nested jaxprs of the body, e.g. a ``jit`` call, stay per step).

``while_loop`` (:mod:`memwise._while`) and the reversible scan (:mod:`memwise._reversible`)
share the carry checks, ``checkpoints`` resolution and closure conversion with this module;
they live below all three in :mod:`memwise._loop_inputs`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from memwise import _binomial, knobs
from memwise import schedule as schedule_lib
from memwise._arguments import check_arrays, non_negative_int, positive_int
from memwise._loop_inputs import (
    check_callable,
    flat_step,
    loop_body,
    resolve_checkpoints,
    strong_carry,
)
from memwise._vjp import fill
from memwise.sharding import first_items

if TYPE_CHECKING:
    from memwise._reversible import DriftLog

__all__ = ["scan", "resolve_checkpoints"]

_SCHEDULES = ("binomial", "nested", "per_step", "none")

_SCAN_FORWARD_MODE = (
    "memwise.scan with schedule='binomial' supports reverse mode (grad, vjp, jacrev; also "
    "jax.hessian and jacfwd of grad) and vmap, but not forward mode through the loop "
    "(jvp, jacfwd, jax.linearize); use memwise.scan(..., schedule='nested') for forward "
    "mode"
)
_SCAN_SECOND_ORDER = (
    "memwise.scan with schedule='binomial' cannot be differentiated twice in reverse "
    "mode (grad of grad, jacrev of grad): its backward pass replays the loop in a "
    "lax.while_loop; use memwise.scan(..., schedule='nested'), or forward-over-reverse "
    "(jax.hessian, jax.jacfwd(jax.grad(f))), which works with schedule='binomial'"
)


# --------------------------------------------------------------------------------------
# input checks


def _scan_length(xs: Any, length: int | None) -> int:
    leaves = jax.tree_util.tree_leaves(xs)
    lengths = set()
    for leaf in leaves:
        shape = np.shape(leaf)
        if not shape:
            raise ValueError(
                f"xs leaves must have a leading axis to scan over; got a scalar leaf of "
                f"type {type(leaf).__name__}"
            )
        lengths.add(shape[0])
    if len(lengths) > 1:
        raise ValueError(
            f"xs leaves have different leading lengths {sorted(lengths)}; every leaf of "
            "xs must have the same number of steps along axis 0"
        )
    if length is not None:
        n = non_negative_int(length, "length", accepts=" (the number of steps)")
        if lengths and n not in lengths:
            raise ValueError(
                f"length={length} does not match the leading axis of xs "
                f"({lengths.pop()}); drop length= or make them agree"
            )
        return n
    if lengths:
        return lengths.pop()
    raise ValueError("xs is None (or has no arrays): pass length= (the number of steps)")


def _check_flags(reverse: Any, unroll: Any) -> None:
    # lax.scan would take reverse="no" as true and fail on unroll="2" deep in its
    # checks without naming it.
    if not isinstance(reverse, (bool, np.bool_)):
        raise TypeError(
            f"reverse must be True or False, got {reverse!r} ({type(reverse).__name__})"
        )
    if isinstance(unroll, (bool, np.bool_)):
        return
    fix = "a bool or an int >= 0 (steps unrolled per iteration, as in jax.lax.scan)"
    if not isinstance(unroll, (int, np.integer)):
        raise TypeError(f"unroll must be {fix}, got {unroll!r} ({type(unroll).__name__})")
    if unroll < 0:
        raise ValueError(f"unroll must be {fix}, got {unroll}")


# --------------------------------------------------------------------------------------
# scan


def scan(
    f: Callable[[Any, Any], tuple[Any, Any]],
    init: Any,
    xs: Any = None,
    length: int | None = None,
    *,
    checkpoints: int | str | None = None,
    schedule: str = "binomial",
    reverse: bool = False,
    unroll: int | bool = 1,
    inverse: Callable[[Any, Any], Any] | None = None,
    drift: DriftLog | None = None,
    offload: str | None = None,
) -> tuple[Any, Any]:
    """``jax.lax.scan`` whose gradient keeps at most ``checkpoints`` carries.

    Same arguments and results as ``jax.lax.scan(f, init, xs, length, reverse=,
    unroll=)``. Under ``jax.grad`` the backward pass replays segments of the loop from
    stored carries following the optimal binomial schedule (``memwise.schedule``).

    Args:
      f: ``(carry, x) -> (new_carry, y)``; may close over arrays (parameters), which get
        gradients. ``y`` may be ``None``.
      init: initial carry (pytree).
      xs: pytree of arrays scanned along axis 0, or None with ``length``.
      length: number of steps when ``xs`` is None (or to check against xs); 0 returns
        ``init`` and empty ys, as ``lax.scan`` does.
      checkpoints: carries kept for the backward pass. ``None`` (default): the fewest
        whose cost is at most 3n body evaluations (about sqrt(2n) carries, one extra
        forward pass); an int >= 1 (fewer = less memory, more recomputation:
        ``memwise.schedule.evaluations(n, c)``); ``"all"``: one per step; ``"auto"``:
        chosen by ``memwise.fit`` under a memory budget (the default outside it).
      schedule: ``"binomial"`` (optimal; reverse mode and forward-over-reverse),
        ``"nested"`` (nested ``lax.scan`` + ``jax.checkpoint``: works under ``jvp``,
        ``vmap``, ``grad(grad)``; ``checkpoints`` bounds its carries, default two
        levels; with ``offload=`` given, any value, it is the steps of a segment),
        ``"per_step"``
        (``lax.scan(jax.checkpoint(f))``: n carries, 2n evaluations) or ``"none"``
        (plain ``lax.scan``: all residuals, n evaluations).
      reverse: as in ``lax.scan``: run the loop from the last step to the first.
      unroll: as in ``lax.scan``; applies to the forward pass.
      inverse: ``(next_carry, x) -> carry``, the exact inverse of ``f``'s carry update,
        for steps that can be undone (a RevNet coupling, reversible Heun): the gradient
        rebuilds each carry from the next instead of keeping it, so its memory is
        constant in the length (2n body, n inverse evaluations). ``checkpoints`` then
        keeps that many carries (default one), evenly spaced, to bound the drift.
      drift: a :class:`memwise.DriftLog` (with ``inverse``) that records, when the
        gradient runs, how far the rebuilt carries drift from the kept ones.
      offload: ``"host"`` (with ``schedule="nested"``) keeps the carries that start the
        loop's segments in the accelerator's host memory (``pinned_host``) and fetches
        each back when the backward pass reaches its segment, overlapped with compute by
        XLA (JAX's offloading ``jax.checkpoint`` policy): the loop runs as segments of
        ``checkpoints`` steps (default about sqrt(n)), each replayed and differentiated
        by ``lax.scan``'s own backward, so the device holds one segment's steps whatever
        the length, the host ``ceil(n / checkpoints)`` carries, and the body is evaluated
        2n times. On a CPU, where host and device memory are the same, it warns and runs
        the same segments on the device; on an accelerator under JAX's
        ``jax_remat3`` flag, whose checkpoint does not apply offloading policies yet, it
        raises. ``"auto"``: the
        same segments, their carries on the device or in host memory as
        :func:`memwise.fit` chooses under its budget (on the device outside ``fit``, and
        wherever ``"host"`` would not offload).

    Returns:
      ``(final_carry, ys)`` exactly as ``jax.lax.scan``.

    Memory/compute: the binomial gradient holds ``min(checkpoints, n)`` carries plus one
    step's residuals, and evaluates the body ``memwise.schedule.evaluations(n, c)`` times
    (``lax.scan`` stores all n steps' residuals and evaluates it n times).

    Example::

        >>> import jax, jax.numpy as jnp, memwise as mw
        >>> def loss(w, xs):
        ...     step = lambda h, x: (jnp.tanh(w * h + x), None)
        ...     h, _ = mw.scan(step, jnp.zeros(3), xs, checkpoints=4)
        ...     return h.sum()
        >>> def loss_lax(w, xs):  # the same loop, every carry kept
        ...     step = lambda h, x: (jnp.tanh(w * h + x), None)
        ...     return jax.lax.scan(step, jnp.zeros(3), xs)[0].sum()
        >>> xs = jnp.ones((100, 3))
        >>> bool(jnp.allclose(jax.grad(loss)(0.5, xs), jax.grad(loss_lax)(0.5, xs)))
        True
    """
    check_callable(f, "f")
    check_arrays(init, "init")
    check_arrays(xs, "xs")
    _check_flags(reverse, unroll)
    if schedule not in _SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not one of {_SCHEDULES}")
    _check_offload(offload, schedule, inverse)
    n = _scan_length(xs, length)
    init, read_only = strong_carry(f, init, first_items(xs))
    if inverse is not None or drift is not None:
        from memwise import _reversible  # the executor; it sits below this public face

        static = (schedule, checkpoints, reverse, unroll)
        return _reversible.scan(f, inverse, init, xs, n, read_only, drift, *static)

    if schedule in ("none", "per_step"):
        if checkpoints is not None:
            raise ValueError(
                f"checkpoints={checkpoints!r} has no effect with schedule={schedule!r}; "
                "drop it or use schedule='binomial'"
            )
        body = f if schedule == "none" else jax.checkpoint(f, prevent_cse=False)
        return lax.scan(body, init, xs, length=n, reverse=reverse, unroll=unroll)
    if n == 0:  # nothing to checkpoint; lax.scan returns init and empty ys
        if schedule == "nested":
            _nested_plan(1, checkpoints, offload is not None)
        elif checkpoints != "auto":
            resolve_checkpoints(checkpoints, 1)
        return lax.scan(f, init, xs, length=0, reverse=reverse)
    if schedule == "nested":
        plan = _nested_plan(n, checkpoints, offload is not None)
        to_host = _to_host(_offload_choice(offload))
        return _nested_scan(f, init, xs, plan, reverse, unroll, to_host)
    c = resolve_checkpoints(checkpoints, n)
    return _binomial_scan(f, init, xs, n, c, reverse, unroll, read_only)


def _check_offload(offload: Any, schedule: str, inverse: Any) -> None:
    if offload is None:
        return
    if offload not in ("host", "auto"):
        raise ValueError(f"offload must be None, 'host' or 'auto', got {offload!r}")
    if inverse is not None:
        raise ValueError(
            f"offload={offload!r} has nothing to offload with inverse=: the gradient "
            "rebuilds each carry from the next instead of keeping it; drop offload="
        )
    if schedule != "nested":
        raise ValueError(
            f"offload={offload!r} runs with schedule='nested' (segments whose starting "
            f"carries live in host memory), not schedule={schedule!r}: binomial's backward "
            "pass stores carries again as it goes; pass schedule='nested'"
        )


# The offloaded segments' predicted time against the same segments on the device: the
# seed LSTM's gradient took 1.03x (10,000 steps) and 1.01x (100,000) on one TPU v5e
# (BENCHMARKS.md, tpu: loops); a margin over that, since the transfers' overlap depends on
# the carry's size against a segment's compute.
OFFLOAD_COST = 1.05


def _offload_candidates() -> tuple:
    """Where ``offload="auto"`` may put the segment carries: host memory too only where
    the device has memory XLA can address as ``pinned_host`` and the offloading policy
    applies (not on a CPU, not under ``jax_remat3``)."""
    device = jax.devices()[0]
    if device.platform == "cpu" or getattr(jax.config, "jax_remat3", False):
        return (None,)
    return (None, "host") if _has_host_memory(device) else (None,)


def _has_host_memory(device: Any) -> bool:
    return "pinned_host" in {m.kind for m in device.addressable_memories()}


def _offload_choice(offload: str | None) -> str | None:
    """``offload="auto"``: the ``"offload"`` knob :func:`memwise.fit` sets (on the device
    first, then host memory; on the device outside ``fit`` and where there is no host
    memory to use). Any other value is the user's."""
    if offload != "auto":
        return offload
    candidates = _offload_candidates()
    if len(candidates) == 1:
        return candidates[0]
    return knobs.auto(
        "offload", candidates=candidates, cost=(1.0, OFFLOAD_COST), default=candidates[0]
    )


def _to_host(offload: str | None, stacklevel: int = 3) -> bool:
    """Whether the segment carries go to host memory: not on a CPU, where host and
    device memory are the same (warned, at the user's call ``stacklevel`` frames up);
    an error on a backend without host memory addressable by XLA."""
    if offload is None:
        return False
    device = jax.devices()[0]
    if device.platform == "cpu":
        warnings.warn(
            "offload='host' on a CPU: host and device memory are the same "
            "there, so the segments' carries stay where they are (the same segmented "
            "schedule runs)",
            UserWarning,
            stacklevel=stacklevel,
        )
        return False
    _check_remat3()
    if not _has_host_memory(device):
        kinds = {m.kind for m in device.addressable_memories()}
        raise ValueError(
            f"offload='host' needs pinned host memory, which {device.platform} devices do "
            f"not expose to XLA (memory kinds: {sorted(kinds)}); drop offload="
        )
    return True


def _check_remat3() -> None:
    """JAX's next ``jax.checkpoint`` (``jax_remat3``, off by default in JAX 0.10) does not
    apply offloading policies yet: the carries would stay on the device, silently."""
    if getattr(jax.config, "jax_remat3", False):
        raise ValueError(
            "offload='host' keeps carries in host memory through jax.checkpoint's "
            "offloading policy, which jax_remat3 (JAX's next checkpoint, turned on here) "
            "does not apply yet; turn jax_remat3 off or drop offload="
        )


def _nested_plan(n: int, checkpoints: Any, segmented: bool = False) -> schedule_lib.NestedSchedule:
    """The nested plan for n steps; ``segmented``: two levels whose segments are
    ``checkpoints`` steps long (about sqrt(n) by default), as host offload runs them."""
    if segmented:
        if checkpoints is None:
            return schedule_lib.segmented(n, schedule_lib.nested(n, 2).chunk)
        steps = positive_int(checkpoints, "checkpoints", accepts=" (steps per segment)")
        return schedule_lib.segmented(n, steps)
    if checkpoints is None:
        return schedule_lib.nested(n, 2)
    positive_int(checkpoints, "checkpoints", accepts=" or None with schedule='nested'")
    fewest = None
    for levels in range(2, max(3, n.bit_length() + 2)):
        plan = schedule_lib.nested(n, levels)
        if plan.carries <= checkpoints:
            return plan
        fewest = plan.carries if fewest is None else min(fewest, plan.carries)
    raise ValueError(
        f"schedule='nested' cannot run {n} steps with checkpoints={checkpoints} (its "
        f"leanest plan keeps {fewest} carries); raise checkpoints or use "
        "schedule='binomial', which works with any checkpoints >= 1"
    )


_HOST_CARRY = "memwise.scan.host_carry"
# XLA:TPU cannot write one element of a host array asynchronously ("Lane slice updating
# is not supported in async dynamic update slice"), which is what storing a scalar carry
# leaf per segment would be: those stay on the device (a few bytes per segment).
_DEVICE_CARRY = "memwise.scan.device_carry"


def _nested_scan(f, init, xs, plan, reverse, unroll, to_host=False):
    """``plan`` run as nested scans; ``to_host``: the top level's segment carries in host
    memory."""

    def run(carry, xs, plan, name=None):
        if plan.levels == 1:
            return lax.scan(f, carry, xs, length=plan.n_steps, reverse=reverse, unroll=unroll)
        q, k = plan.n_chunks, plan.chunk
        main = jax.tree_util.tree_map(lambda a: a[: q * k].reshape((q, k) + a.shape[1:]), xs)
        rest = jax.tree_util.tree_map(lambda a: a[q * k :], xs)
        chunk_fn = jax.checkpoint(lambda c, x: run(c, x, plan.inner), prevent_cse=False)
        rest_fn = None
        if plan.remainder_inner is not None:
            rest_fn = lambda c, x: run(c, x, plan.remainder_inner)
            # Under the offloading policy the remainder is replayed once for its
            # residuals; a checkpoint of its own would replay it a second time.
            rest_fn = rest_fn if name else jax.checkpoint(rest_fn, prevent_cse=False)
        name = name or (lambda c: c)
        ys_rest = None
        if reverse and rest_fn is not None:
            carry, ys_rest = rest_fn(name(carry), rest)
        step = lambda c, x: chunk_fn(name(c), x)
        carry, ys_main = lax.scan(step, carry, main, length=q, reverse=reverse)
        if not reverse and rest_fn is not None:
            carry, ys_rest = rest_fn(name(carry), rest)
        ys_main = jax.tree_util.tree_map(lambda a: a.reshape((q * k,) + a.shape[2:]), ys_main)
        if ys_rest is None:
            return carry, ys_main
        return carry, jax.tree_util.tree_map(lambda a, b: jnp.concatenate([a, b]), ys_main, ys_rest)

    if not to_host or plan.levels == 1:
        return run(init, xs, plan)
    # The carry entering each segment is named; under a policy that saves nothing else
    # and offloads that name, JAX stores those carries in host memory and XLA fetches
    # each back (asynchronously) for its segment's backward; everything else is replayed.
    policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[_DEVICE_CARRY],
        names_which_can_be_offloaded=[_HOST_CARRY],
        offload_src="device",
        offload_dst="pinned_host",
    )
    where = lambda a: _HOST_CARRY if jnp.ndim(a) else _DEVICE_CARRY
    name = lambda c: jax.tree_util.tree_map(lambda a: checkpoint_name(a, where(a)), c)
    offloaded = jax.checkpoint(lambda c, x: run(c, x, plan, name), policy=policy, prevent_cse=False)
    return offloaded(init, xs)


def _binomial_scan(f, init, xs, n, c, reverse, unroll, read_only):
    carry_leaves, carry_def = jax.tree_util.tree_flatten(init)
    x_leaves, x_def = jax.tree_util.tree_flatten(xs)
    y_def_box: list = []
    flat = flat_step(f, carry_def, x_def, y_def_box)
    body, consts, loop_carry, x_leaves = loop_body(flat, carry_leaves, x_leaves, read_only)
    y_def = y_def_box[0]
    loop = _binomial.Loop(
        body=body,
        n_steps=n,
        forward=schedule_lib.forward_positions(n, c),
        reverse=reverse,
        unroll=unroll,
        forward_mode_error=_SCAN_FORWARD_MODE,
        second_order_error=_SCAN_SECOND_ORDER,
    )
    carry_out, ys = _binomial.run(loop, consts, loop_carry, x_leaves)
    carry_out = fill(carry_leaves, [not r for r in read_only], carry_out)
    return (
        jax.tree_util.tree_unflatten(carry_def, carry_out),
        jax.tree_util.tree_unflatten(y_def, ys),
    )


def __getattr__(name: str) -> Any:
    # ``memwise.scan.while_loop``, the import path before ``while_loop`` had its module
    if name == "while_loop":
        from memwise._while import while_loop

        return while_loop
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
