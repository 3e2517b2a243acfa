"""``while_loop``: ``jax.lax.while_loop`` whose reverse mode keeps O(checkpoints) carries.

A while loop does not know its trip count while it runs, so it cannot use the offline
binomial schedule of :func:`memwise.scan`: by default it places its checkpoints online
(:class:`memwise.schedule.OnlineCheckpointer`, Stumm & Walther 2010, executed by
:mod:`memwise._online`) and reverses each stretch between kept carries with revolve, so
its memory, program and recomputation follow the steps that ran, never ``max_steps``
(which may be None). It matches the offline optimum below (c+1)(c+2)/2 steps and stays
within 5% of it at c >= 4 up to 10,000 steps. Its ``buffers=`` (arrays the body only
writes, e.g. an ODE solution at save times) stay outside the checkpoints
(:mod:`memwise._buffers`). The carry checks and the closure conversion of the body are
the ones ``scan`` uses (:mod:`memwise._loop_inputs`). A bounded loop can instead run
all of its ``max_steps`` steps as ``scan``'s nested segments (``schedule="nested"``,
whose costs follow ``max_steps``, not the steps that ran).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from memwise import _buffers, _online
from memwise._arguments import check_arrays, positive_int
from memwise._loop_inputs import check_callable, loop_body, resolve_checkpoints, strong_carry
from memwise._vjp import closure_convert, fill, select

__all__ = ["while_loop"]

_WHILE_FORWARD_MODE = (
    "memwise.while_loop supports reverse mode (grad, vjp, jacrev; also jax.hessian and "
    "jacfwd of grad) and vmap, but not forward mode through the loop (jvp, jacfwd, "
    "jax.linearize); for forward mode use jax.lax.while_loop, whose jvp keeps no carries"
)
_WHILE_SECOND_ORDER = (
    "memwise.while_loop cannot be differentiated twice in reverse mode (grad of grad, "
    "jacrev of grad): its backward pass replays the loop in a lax.while_loop; use "
    "forward-over-reverse instead (jax.hessian, jax.jacfwd(jax.grad(f))), which works"
)


def while_loop(
    cond_fun: Callable[[Any], Any],
    body_fun: Callable[[Any], Any],
    init: Any,
    *,
    max_steps: int | None = None,
    checkpoints: int | str | None = None,
    buffers: Callable[[Any], Any] | None = None,
    schedule: str = "online",
    offload: str | None = None,
) -> Any:
    """``jax.lax.while_loop`` that is reverse-differentiable with O(checkpoints) memory.

    Runs ``body_fun`` while ``cond_fun(carry)`` is true, without a bound
    (``max_steps=None``, as ``lax.while_loop``) or at most ``max_steps`` times (the loop
    stops there, as Equinox's checkpointed loops and Diffrax's ``max_steps`` do). Under
    ``jax.grad`` the forward pass decides step by step which carries to keep, without
    knowing how long the loop will run (``memwise.schedule.OnlineCheckpointer``), and
    the backward pass reverses each stretch between kept carries with optimal revolve.

    Args:
      cond_fun: ``carry -> bool scalar``.
      body_fun: ``carry -> carry`` (same structure, shapes, dtypes); may close over
        arrays, which get gradients.
      init: initial carry (pytree).
      max_steps: None (no bound) or an int >= 1 bounding the trip count. With the
        online schedule it changes no cost: memory, compile time and the schedule follow
        the steps that actually ran
        (a bounded loop uses the same online schedule: planning the offline optimum for
        ``max_steps`` pays off only when the loop runs nearly all of them, and then saves
        at most a few percent).
      checkpoints: carries kept for the backward pass (x_0 included): an int >= 1, or
        with ``max_steps``, ``None``/``"auto"``/``"all"`` as in :func:`scan` for
        ``max_steps`` steps. Unbounded loops need an int. With ``schedule="nested"``:
        the steps of a segment, an int >= 1 or None (about sqrt(max_steps)).
      buffers: None, or ``carry -> the carry's write-only buffers`` (a leaf or a pytree
        of leaves of the carry, e.g. ``lambda s: s.saved``), as Equinox's checkpointed
        ``while_loop`` takes it: arrays the body writes at traced indices
        (``buf.at[i].set(value)``, optionally ``pred=``) and never reads. They are not
        checkpointed: the backward pass reads their cotangents at the indices written,
        so an ``(n_saves, ...)`` output costs its own size once, not once per
        checkpoint. The body (and ``cond_fun``) sees a write-only view: a read raises a
        ``TypeError``; a static index out of range raises an ``IndexError``; a traced one
        is dropped, as in ``jax.numpy`` (its value gets a zero gradient). Of two writes
        at one index the later one wins and alone receives a gradient, as in JAX.
      schedule: ``"online"`` (default: the placement above) or ``"nested"``, for a
        bounded loop (``max_steps``): all ``max_steps`` steps as segments of
        ``checkpoints`` steps (default about sqrt(max_steps)) in a ``lax.scan``, each
        step a select that keeps the carry once ``cond_fun`` is false, each segment
        replayed and differentiated by ``lax.scan``'s own backward under
        ``jax.checkpoint``: ``ceil(max_steps / checkpoints)`` segment carries, one
        segment's residuals, 2 ``max_steps`` body evaluations whenever the loop stops.
        For loops that run close to their bound: on an accelerator its steps cost what
        ``lax.scan``'s do, where the online placement's per-step decisions cost more than
        a small body, and every transformation works (``jvp``, ``grad`` of ``grad``).
        The steps after the stop evaluate ``body_fun`` on the final carry and discard
        the result (as ``lax.while_loop`` under ``vmap`` treats finished lanes): a body
        that is not finite there can make gradients NaN. No ``buffers``.
      offload: with ``schedule="nested"``, ``"host"`` keeps the segment carries in the
        accelerator's host memory and ``"auto"`` lets :func:`memwise.fit` choose, as
        :func:`memwise.scan`'s ``offload`` (on a CPU ``"host"`` warns and keeps them on
        the device).

    Returns:
      The final carry, as ``lax.while_loop``.

    Memory/compute (the online schedule; ``schedule="nested"`` is described above):
    ``checkpoints`` carries and O(checkpoints) integers, whatever the trip count N or
    ``max_steps``. The gradient evaluates the body
    ``memwise.schedule.online_evaluations(N, c)`` times: exactly the offline optimum
    ``evaluations(N, c)`` while N < (c+1)(c+2)/2, and measured within 5.0%, 4.0%, 2.0%,
    0.1% of it for every N <= 10,000 at c = 4, 8, 16, 64 (``benchmarks/while_loop.py``;
    Equinox's checkpointed while loop needs more at equal c). Reverse mode only:
    forward mode raises a ``TypeError`` pointing to ``jax.lax.while_loop`` (or use
    ``schedule="nested"`` with ``max_steps``, which every transformation goes through).

    Example::

        >>> import jax, jax.numpy as jnp, memwise as mw
        >>> def newton(a):   # iterate until converged; nobody knows how many steps
        ...     x, _ = mw.while_loop(lambda s: jnp.abs(s[0] * s[0] - a) > 1e-6 * a,
        ...                          lambda s: (0.5 * (s[0] + a / s[0]), s[1] + 1),
        ...                          (a, 0), checkpoints=4)
        ...     return x
        >>> round(float(jax.grad(newton)(4.0)), 4)  # d sqrt(a)/da = 1/(2 sqrt(a))
        0.25
    """
    if schedule == "nested":
        return _nested_while_loop(
            cond_fun, body_fun, init, max_steps, checkpoints, buffers, offload
        )
    if schedule != "online":
        raise ValueError(f"schedule must be 'online' or 'nested', got {schedule!r}")
    if offload is not None:
        raise ValueError(
            f"offload={offload!r} runs with schedule='nested' (segments whose starting "
            "carries live in host memory) and max_steps; the online placement moves its "
            "carries as it goes: pass schedule='nested', max_steps=..."
        )
    return checked_while_loop(
        cond_fun, body_fun, init, max_steps=max_steps, checkpoints=checkpoints, buffers=buffers
    )


def _nested_while_loop(cond_fun, body_fun, init, max_steps, checkpoints, buffers, offload):
    """``schedule="nested"``: ``max_steps`` selected steps run as the nested scan's
    segments (:func:`memwise.scan`'s executor, its host offload included); a stopped
    loop's carry never changes, so the steps after the stop keep it.

    Skipping the segments after the stop (a ``lax.cond`` per segment, inside its
    checkpoint) made Dormand-Prince under a bound of 4,096 steps 5.6x faster on CPU; on
    a TPU v5e it made a 10,000-step LSTM's gradient 2.3x slower and its temporaries grow
    with the steps (73.6 MiB against 0.6), so every step runs."""
    from memwise.scan import _check_offload, _nested_plan, _nested_scan, _offload_choice, _to_host

    check_callable(cond_fun, "cond_fun")
    check_callable(body_fun, "body_fun")
    if max_steps is None:
        raise ValueError(
            "schedule='nested' runs max_steps steps as segments of a lax.scan: pass "
            "max_steps=<int>, a bound on the trip count, or use schedule='online'"
        )
    max_steps = positive_int(max_steps, "max_steps", accepts=" with schedule='nested'")
    if buffers is not None:
        raise ValueError(
            "buffers= runs with schedule='online': the nested schedule keeps whole carries "
            "at its segments' starts, so write-only buffers would be stored with each; "
            "keep them in the carry or use schedule='online'"
        )
    _check_offload(offload, "nested", None)
    for i, leaf in enumerate(jax.tree_util.tree_leaves(init)):
        if isinstance(leaf, _buffers.WriteOnlyBuffer):
            raise ValueError(
                f"carry leaf {i} is a buffer of an enclosing loop, which schedule='nested' "
                "cannot carry (it keeps whole carries at its segments' starts and takes no "
                "buffers=); use schedule='online' and name it in buffers="
            )
    check_arrays(init, "init")
    init, _ = strong_carry(lambda c, _: (body_fun(c), None), init, None, name="body_fun")
    _check_predicate(cond_fun, init)

    def step(carry, _):
        # A select, not a lax.cond: differentiated in a scan, a cond keeps the arrays
        # body_fun closes over (its parameters) as residuals of every step.
        go = cond_fun(carry)
        new = body_fun(carry)
        return jax.tree_util.tree_map(lambda a, b: jnp.where(go, a, b), new, carry), None

    plan = _nested_plan(max_steps, checkpoints, True)
    to_host = _to_host(_offload_choice(offload), stacklevel=4)
    return _nested_scan(step, init, None, plan, False, 1, to_host)[0]


def _check_predicate(cond_of: Callable, carry: Any) -> None:
    pred = jax.eval_shape(cond_of, carry)
    if getattr(pred, "shape", None) != () or pred.dtype != jnp.bool_:
        raise TypeError(
            f"cond_fun must return a boolean scalar, got {getattr(pred, 'dtype', pred)}"
            f"{list(getattr(pred, 'shape', []))}"
        )


def checked_while_loop(
    cond_fun: Callable[[Any], Any],
    body_fun: Callable[[Any], Any],
    init: Any,
    *,
    max_steps: int | None,
    checkpoints: int | str | None,
    buffers: Callable[[Any], Any] | None,
    forward_mode_error: str = _WHILE_FORWARD_MODE,
    writes_once: bool = False,
) -> Any:
    """:func:`while_loop` with the ``TypeError`` message of forward mode chosen by the
    caller (an adapter names its own fix, e.g. Diffrax's ``ForwardMode``), and
    ``writes_once`` for a caller that writes each index of its buffers at most once
    (:class:`memwise._online.OnlineLoop`)."""
    check_callable(cond_fun, "cond_fun")
    check_callable(body_fun, "body_fun")
    is_buffer = _buffers.buffer_mask(buffers, init)
    leaves, init_def = jax.tree_util.tree_flatten(init)
    # the buffers of an enclosing loop's body, passed on to this nested loop
    leaves, outer_tags = _buffers.unwrap_outer(leaves, is_buffer)
    init = jax.tree_util.tree_unflatten(init_def, leaves)
    check_arrays(init, "init")
    if max_steps is not None:
        max_steps = positive_int(max_steps, "max_steps", accepts=" or None (no bound)")
        c = resolve_checkpoints(checkpoints, max_steps)
    else:
        if isinstance(checkpoints, bool) or not isinstance(checkpoints, (int, np.integer)):
            raise ValueError(
                f"checkpoints={checkpoints!r} needs max_steps: an unbounded while_loop "
                "(max_steps=None) takes checkpoints=<int>, the carries to keep (e.g. 16), "
                "or pass max_steps= to size None/'auto'/'all' from it"
            )
        c = resolve_checkpoints(checkpoints, 1 << 30)
    tags = [object() for b in is_buffer if b]
    state_mask = [not b for b in is_buffer]

    def array_body(carry):
        # body_fun on the carry of arrays: the buffers go in as write-only views
        leaves = jax.tree_util.tree_leaves(carry)
        views = _buffers.wrap(select(leaves, is_buffer), tags)
        out = body_fun(jax.tree_util.tree_unflatten(init_def, fill(leaves, is_buffer, views)))
        out_leaves, out_def = jax.tree_util.tree_flatten(out)
        if out_def != init_def or not any(is_buffer):  # type: ignore[operator]
            return out  # (a changed structure is reported by strong_carry)
        arrays = _buffers.unwrap(select(out_leaves, is_buffer), tags, name="body_fun")
        return jax.tree_util.tree_unflatten(init_def, fill(out_leaves, is_buffer, arrays))

    init, read_only = strong_carry(lambda c, _: (array_body(c), None), init, None, name="body_fun")
    carry_leaves, carry_def = jax.tree_util.tree_flatten(init)
    written_init = select(carry_leaves, is_buffer)
    cond_views = _buffers.wrap(written_init, [object() for _ in written_init])

    def cond_of(leaves):
        return cond_fun(
            jax.tree_util.tree_unflatten(carry_def, fill(leaves, is_buffer, cond_views))
        )

    _check_predicate(cond_of, carry_leaves)
    state_leaves = select(carry_leaves, state_mask)
    state_read_only = select(read_only, state_mask)
    moving = [not r for r in state_read_only]

    def flat_body(state, written):
        leaves = fill(fill(carry_leaves, state_mask, state), is_buffer, written)
        out = jax.tree_util.tree_leaves(array_body(jax.tree_util.tree_unflatten(carry_def, leaves)))
        return select(out, state_mask), select(out, is_buffer)

    def flat_cond(loop_leaves):
        return cond_of(fill(carry_leaves, state_mask, fill(state_leaves, moving, loop_leaves)))

    body_conv, body_consts, loop_carry, written = loop_body(
        flat_body, state_leaves, written_init, state_read_only, item=list
    )
    cond_conv, cond_consts = closure_convert(flat_cond, loop_carry)
    # The predicate is not differentiated: its closed-over arrays need no cotangent.
    cond_consts = [lax.stop_gradient(a) for a in cond_consts]
    loop = _online.OnlineLoop(
        body=body_conv,
        cond=cond_conv,
        n_checkpoints=c,
        max_steps=max_steps,
        writes_once=writes_once,
        forward_mode_error=forward_mode_error,
        second_order_error=_WHILE_SECOND_ORDER,
    )
    out, written = _online.run(loop, body_consts, cond_consts, loop_carry, written)
    leaves = fill(carry_leaves, state_mask, fill(state_leaves, moving, out))
    leaves = fill(leaves, is_buffer, written)
    leaves = [
        leaf if tag is None else _buffers.WriteOnlyBuffer(leaf, tag)
        for leaf, tag in zip(leaves, outer_tags)
    ]
    return jax.tree_util.tree_unflatten(carry_def, leaves)
