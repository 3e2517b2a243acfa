"""``scan`` and ``while_loop`` whose reverse mode keeps O(checkpoints) carries, not O(n).

``jax.lax.scan`` under ``jax.grad`` stores every step's residuals; wrapping the body in
``jax.checkpoint`` still stores one carry per step (the seed's Flax LSTM: 10,000 carries).
Chen et al. (2016) reach O(sqrt n) memory by replaying segments; the optimal way to do it
for a loop of known length is the binomial ("revolve") schedule of Griewank & Walther
(2000), computed in :mod:`memwise.schedule`. Here it is executed:

* the forward pass is one ``lax.scan`` that also writes the scheduled carries into a
  stacked ``(n_slots, ...)`` buffer (one dynamic slot write per step);
* the backward pass (a ``custom_vjp``) is one ``fori_loop`` over the reversed steps whose
  body restores a slot, advances in an inner ``while_loop`` (storing as the schedule says)
  and differentiates one step. The schedule enters as integer arrays, so the compiled
  program and its compile time do not depend on n.

``xs`` are read by index (never copied into checkpoints), ``ys`` are written once by the
forward pass, and arrays the body closes over receive gradients (``jax.closure_convert``).

Trade-offs, honestly:

* ``schedule="binomial"`` is a ``custom_vjp``: reverse mode (``grad``, ``vjp``,
  ``jacrev``) and ``vmap`` work; ``jvp``/``jacfwd`` raise a ``TypeError`` naming
  ``schedule="nested"`` (nested ``lax.scan`` + ``jax.checkpoint``: any transformation,
  ~``levels * n**(1/levels)`` carries, ``levels * n`` evaluations). When the forward-mode
  transformation wraps a ``jit`` that contains the scan, the scan cannot see it and JAX's
  own ``TypeError`` ("can't apply forward-mode autodiff (jvp) to a custom_vjp function")
  comes instead.
* The schedule is baked into the program as int32 arrays of about 5n entries (2 MB at
  n = 100,000): constants, not temporaries.
* ``while_loop`` runs the binomial schedule of ``max_steps`` with the steps after
  termination skipped: O(checkpoints) memory, but its recomputation is that of the
  ``max_steps`` schedule restricted to the steps that ran (each step replayed at most t
  times, beta(c, t) >= max_steps), and its backward loop spends a cheap iteration on each
  of the ``max_steps`` schedule entries. An online schedule (Stumm & Walther 2010) would
  adapt to the actual trip count; it is not implemented.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from memwise import knobs
from memwise import schedule as schedule_lib

__all__ = ["scan", "while_loop", "resolve_checkpoints"]

_SCHEDULES = ("binomial", "nested", "per_step", "none")
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
    if isinstance(checkpoints, bool) or not isinstance(checkpoints, (int, np.integer)):
        raise TypeError(
            f"checkpoints must be an int >= 1, None, 'all' or 'auto', got "
            f"{type(checkpoints).__name__}"
        )
    if checkpoints < 1:
        raise ValueError(
            f"checkpoints={checkpoints} must be >= 1 (the number of carries kept); use "
            "checkpoints=1 for the least memory"
        )
    return min(int(checkpoints), n)


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
        if isinstance(length, bool) or not isinstance(length, (int, np.integer)):
            raise TypeError(f"length must be an int, got {type(length).__name__}")
        if lengths and int(length) not in lengths:
            raise ValueError(
                f"length={length} does not match the leading axis of xs "
                f"({lengths.pop()}); drop length= or make them agree"
            )
        n = int(length)
    elif lengths:
        n = lengths.pop()
    else:
        raise ValueError("xs is None (or has no arrays): pass length= (the number of steps)")
    if n < 1:
        raise ValueError(
            f"the scan has length {n}; memwise.scan needs at least one step (for an empty "
            "loop use jax.lax.scan)"
        )
    return n


def _check_callable(fn: Any, name: str) -> None:
    if not callable(fn):
        raise TypeError(f"{name} must be callable, got {type(fn).__name__}")


def _describe(tree: Any) -> str:
    return str(jax.tree_util.tree_map(lambda a: f"{a.dtype}{list(a.shape)}", tree))


def _strong_carry(f: Callable, init: Any, x_example: Any, *, name: str = "f") -> Any:
    """Checks that f keeps the carry's structure, shapes and dtypes; returns init.

    Like ``lax.scan``, a weakly typed init (a Python float) takes the dtype the body
    returns, so ``init=0.0`` works with a float32 body.
    """
    init = jax.tree_util.tree_map(jnp.asarray, init)
    out = jax.eval_shape(f, init, x_example)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(f"{name} must return a pair (new_carry, y); got {type(out).__name__}")
    new_carry = out[0]
    in_def = jax.tree_util.tree_structure(init)
    out_def = jax.tree_util.tree_structure(new_carry)
    if in_def != out_def:
        raise TypeError(
            f"{name} changed the carry's structure: init is {in_def} but {name} returned "
            f"{out_def}; return a carry with the same pytree structure as init"
        )
    fixed = []
    for a, b in zip(jax.tree_util.tree_leaves(init), jax.tree_util.tree_leaves(new_carry)):
        if a.shape != b.shape or a.dtype != b.dtype:
            if a.shape == b.shape and getattr(a, "weak_type", False):
                fixed.append(lax.convert_element_type(a, b.dtype))
                continue
            raise TypeError(
                f"{name} changed the carry's shapes/dtypes: init is {_describe(init)} but "
                f"{name} returned {_describe(new_carry)}; cast the new carry to the init's "
                "dtypes and keep its shapes"
            )
        fixed.append(a)
    return jax.tree_util.tree_unflatten(in_def, fixed)


def _reject_forward_mode(leaves: list, what: str) -> None:
    # grad uses LinearizeTracer; a JVPTracer with a nonzero tangent means forward mode,
    # which a custom_vjp cannot do. JAX's own error would not say what to use instead.
    from jax._src.interpreters import ad

    for leaf in leaves:
        if isinstance(leaf, ad.JVPTracer) and not isinstance(leaf.tangent, ad.Zero):
            raise TypeError(
                f"{what} with schedule='binomial' supports reverse mode (grad, vjp, "
                "jacrev) and vmap but not forward mode (jvp, jacfwd, hessian); use "
                "memwise.scan(..., schedule='nested') for forward mode or grad-of-grad"
            )


# --------------------------------------------------------------------------------------
# shared executor pieces


def _is_diff(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _take(tree: list, index: Any) -> list:
    return [lax.dynamic_index_in_dim(a, index, 0, keepdims=False) for a in tree]


def _store(buffers: list, values: list, slot: Any, do: Any) -> list:
    # Read-select-write touches one slot per step instead of the whole buffer, and keeps
    # the update in place inside XLA loops.
    out = []
    for buf, val in zip(buffers, values):
        old = lax.dynamic_index_in_dim(buf, slot, 0, keepdims=False)
        out.append(lax.dynamic_update_index_in_dim(buf, jnp.where(do, val, old), slot, 0))
    return out


def _int_array(values) -> jax.Array:
    arr = np.asarray(values, dtype=np.int64)
    if arr.size == 0:
        arr = np.full((1,), -1, dtype=np.int64)
    return jnp.asarray(arr.astype(np.int32))


class _Differentiator:
    """vjp of one step with respect to the leaves that need a cotangent.

    The carry's inexact leaves always do (they carry the gradient between steps); xs and
    closed-over leaves only when inexact *and* perturbed (``custom_vjp`` with symbolic
    zeros says which), so ``grad`` with respect to parameters alone never builds the
    (n, ...) cotangent of xs.
    """

    def __init__(self, step: Callable, carry: list, x: list, consts: list,
                 x_perturbed: list, const_perturbed: list):
        self.step = step
        self.carry_mask = [_is_diff(a) for a in carry]
        self.x_mask = [_is_diff(a) and p for a, p in zip(x, x_perturbed)]
        self.const_mask = [_is_diff(a) and p for a, p in zip(consts, const_perturbed)]
        _, y_shapes = jax.eval_shape(step, carry, x, consts)
        self.y_shapes = y_shapes
        self.y_mask = [_is_diff(a) for a in y_shapes]

    @staticmethod
    def split(values, mask):
        return [v for v, m in zip(values, mask) if m]

    @staticmethod
    def merge(diff, full, mask):
        diff = iter(diff)
        return [next(diff) if m else v for v, m in zip(full, mask)]

    @staticmethod
    def full(diff, mask):
        """Cotangent list for custom_vjp: None (zero) where no cotangent was computed."""
        diff = iter(diff)
        return [next(diff) if m else None for m in mask]

    def __call__(self, carry, x, consts, ct_carry, ct_y):
        """Cotangents of (carry, x, consts), each restricted to its mask.

        ``ct_carry`` holds the carry mask's leaves; ``ct_y`` one entry per y leaf, None
        for a zero cotangent.
        """

        def diff_step(carry_d, x_d, consts_d):
            new_carry, y = self.step(
                self.merge(carry_d, carry, self.carry_mask),
                self.merge(x_d, x, self.x_mask),
                self.merge(consts_d, consts, self.const_mask),
            )
            return self.split(new_carry, self.carry_mask), self.split(y, self.y_mask)

        _, vjp = jax.vjp(
            diff_step,
            self.split(carry, self.carry_mask),
            self.split(x, self.x_mask),
            self.split(consts, self.const_mask),
        )
        ct_y = [
            jnp.zeros(shape.shape, shape.dtype) if ct is None else ct
            for ct, shape in zip(ct_y, self.y_shapes)
        ]
        return vjp((ct_carry, self.split(ct_y, self.y_mask)))


def _primal_values(args: list) -> tuple[list, list]:
    """Values and perturbed flags of custom_vjp(symbolic_zeros=True) primal inputs."""
    return [a.value for a in args], [bool(a.perturbed) for a in args]


def _is_symbolic_zero(ct: Any) -> bool:
    from jax.custom_derivatives import SymbolicZero

    return isinstance(ct, SymbolicZero)


def _dense(ct: Any, like: Any) -> Any:
    return jnp.zeros(jnp.shape(like), jnp.result_type(like)) if _is_symbolic_zero(ct) else ct


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
      length: number of steps when ``xs`` is None (or to check against xs).
      checkpoints: carries kept for the backward pass. ``None`` (default): the fewest
        whose cost is at most 3n body evaluations (about sqrt(2n) carries, one extra
        forward pass); an int >= 1 (fewer = less memory, more recomputation:
        ``memwise.schedule.evaluations(n, c)``); ``"all"``: one per step; ``"auto"``:
        chosen by ``memwise.fit`` under a memory budget (the default outside it).
      schedule: ``"binomial"`` (optimal, reverse mode only), ``"nested"`` (nested
        ``lax.scan`` + ``jax.checkpoint``: works under ``jvp``, ``vmap``, ``grad(grad)``;
        ``checkpoints`` bounds its carries, default two levels), ``"per_step"``
        (``lax.scan(jax.checkpoint(f))``: n carries, 2n evaluations) or ``"none"``
        (plain ``lax.scan``: all residuals, n evaluations).
      reverse, unroll: as in ``lax.scan`` (``unroll`` applies to the forward pass).

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
        >>> g = jax.grad(loss)(0.5, jnp.ones((100, 3)))
    """
    _check_callable(f, "f")
    if schedule not in _SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not one of {_SCHEDULES}")
    n = _scan_length(xs, length)
    x_example = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(np.shape(a)[1:], jnp.result_type(a)), xs
    )
    init = _strong_carry(f, init, x_example)

    if schedule in ("none", "per_step"):
        if checkpoints is not None:
            raise ValueError(
                f"checkpoints={checkpoints!r} has no effect with schedule={schedule!r}; "
                "drop it or use schedule='binomial'"
            )
        body = f if schedule == "none" else jax.checkpoint(f, prevent_cse=False)
        return lax.scan(body, init, xs, length=n, reverse=reverse, unroll=unroll)
    if schedule == "nested":
        plan = _nested_plan(n, checkpoints)
        return _nested_scan(f, init, xs, plan, reverse, unroll)
    c = resolve_checkpoints(checkpoints, n)
    return _binomial_scan(f, init, xs, n, c, reverse, unroll)


def _nested_plan(n: int, checkpoints: Any) -> schedule_lib.NestedSchedule:
    if checkpoints is None:
        return schedule_lib.nested(n, 2)
    if isinstance(checkpoints, str) or isinstance(checkpoints, bool) or not isinstance(
        checkpoints, (int, np.integer)
    ):
        raise ValueError(
            f"schedule='nested' takes checkpoints=None or an int, got {checkpoints!r}"
        )
    if checkpoints < 1:
        raise ValueError(f"checkpoints={checkpoints} must be >= 1")
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


def _nested_scan(f, init, xs, plan, reverse, unroll):
    def run(carry, xs, plan):
        if plan.levels == 1:
            return lax.scan(f, carry, xs, length=plan.n_steps, reverse=reverse, unroll=unroll)
        q, k = plan.n_chunks, plan.chunk
        main = jax.tree_util.tree_map(lambda a: a[: q * k].reshape((q, k) + a.shape[1:]), xs)
        rest = jax.tree_util.tree_map(lambda a: a[q * k :], xs)
        chunk_fn = jax.checkpoint(lambda c, x: run(c, x, plan.inner), prevent_cse=False)
        rest_fn = (
            jax.checkpoint(lambda c, x: run(c, x, plan.remainder_inner), prevent_cse=False)
            if plan.remainder_inner is not None
            else None
        )
        ys_rest = None
        if reverse and rest_fn is not None:
            carry, ys_rest = rest_fn(carry, rest)
        carry, ys_main = lax.scan(chunk_fn, carry, main, length=q, reverse=reverse)
        if not reverse and rest_fn is not None:
            carry, ys_rest = rest_fn(carry, rest)
        ys_main = jax.tree_util.tree_map(lambda a: a.reshape((q * k,) + a.shape[2:]), ys_main)
        if ys_rest is None:
            return carry, ys_main
        return carry, jax.tree_util.tree_map(
            lambda a, b: jnp.concatenate([a, b]), ys_main, ys_rest
        )

    return run(init, xs, plan)


def _flat_step(f, carry_def, x_def, y_def_box):
    def step(carry_leaves, x_leaves):
        carry = jax.tree_util.tree_unflatten(carry_def, carry_leaves)
        x = jax.tree_util.tree_unflatten(x_def, x_leaves)
        new_carry, y = f(carry, x)
        y_leaves, y_def = jax.tree_util.tree_flatten(y)
        y_def_box[:] = [y_def]
        return jax.tree_util.tree_leaves(new_carry), y_leaves

    return step


def _binomial_scan(f, init, xs, n, c, reverse, unroll):
    sched = schedule_lib.binomial(n, c)
    carry_leaves, carry_def = jax.tree_util.tree_flatten(init)
    x_leaves, x_def = jax.tree_util.tree_flatten(xs)
    y_def_box: list = []
    flat = _flat_step(f, carry_def, x_def, y_def_box)
    x_example = [jnp.zeros(np.shape(a)[1:], jnp.result_type(a)) for a in x_leaves]
    converted, consts = jax.closure_convert(flat, carry_leaves, x_example)
    y_def = y_def_box[0]
    _reject_forward_mode(list(consts) + carry_leaves + x_leaves, "memwise.scan")

    def step(carry, x, consts):
        return converted(carry, x, *consts)

    def time_index(i):
        return n - 1 - i if reverse else i

    @jax.custom_vjp
    def run(consts, carry, x_leaves):
        return lax.scan(
            lambda c, x: step(c, x, consts), carry, x_leaves, length=n, reverse=reverse,
            unroll=unroll,
        )

    perturbed: dict = {}  # set while tracing run_fwd, read by run_bwd (static flags)

    def run_fwd(consts, carry, x_leaves):
        consts, perturbed["consts"] = _primal_values(consts)
        carry, perturbed["carry"] = _primal_values(carry)
        x_leaves, perturbed["xs"] = _primal_values(x_leaves)
        forward = jnp.asarray(np.asarray(sched.forward_positions, dtype=np.int32))
        n_forward = len(sched.forward_positions)
        buffers = [jnp.zeros((sched.n_slots,) + a.shape, a.dtype) for a in carry]

        def body(state, x):
            carry, buffers, i, stored = state
            slot = jnp.minimum(stored, n_forward - 1)
            do = (stored < n_forward) & (forward[slot] == i)
            buffers = _store(buffers, carry, slot, do)
            carry, y = step(carry, x, consts)
            return (carry, buffers, i + 1, stored + do.astype(jnp.int32)), y

        (carry, buffers, _, _), ys = lax.scan(
            body, (carry, buffers, jnp.int32(0), jnp.int32(0)), x_leaves, length=n,
            reverse=reverse, unroll=unroll,
        )
        return (carry, ys), (consts, x_leaves, buffers)

    def run_bwd(residuals, cotangents):
        consts, x_leaves, buffers = residuals
        ct_carry, ct_ys = cotangents
        carry0 = [b[0] for b in buffers]
        x0 = [a[0] for a in x_leaves]
        vjp_step = _Differentiator(
            step, carry0, x0, consts, perturbed["xs"], perturbed["consts"]
        )
        ct_carry = vjp_step.split(
            [_dense(ct, a) for ct, a in zip(ct_carry, carry0)], vjp_step.carry_mask
        )
        ct_ys = [None if _is_symbolic_zero(ct) else ct for ct in ct_ys]
        ct_consts = [jnp.zeros_like(a) for a in vjp_step.split(consts, vjp_step.const_mask)]
        ct_xs = [jnp.zeros_like(a) for a in vjp_step.split(x_leaves, vjp_step.x_mask)]
        arrays = _schedule_arrays(sched)

        def advance(i, carry):
            return step(carry, _take(x_leaves, time_index(i)), consts)[0]

        def reverse_step(k, state):
            ct_carry, ct_consts, ct_xs, buffers = state
            r = n - 1 - k
            carry, buffers = _replay(arrays, k, r, buffers, advance, limit=None)
            t = time_index(r)
            ct_y = [None if ct is None else _take([ct], t)[0] for ct in ct_ys]
            ct_c, ct_x, ct_k = vjp_step(carry, _take(x_leaves, t), consts, ct_carry, ct_y)
            ct_consts = [a + b for a, b in zip(ct_consts, ct_k)]
            ct_xs = [lax.dynamic_update_index_in_dim(a, b, t, 0) for a, b in zip(ct_xs, ct_x)]
            return ct_c, ct_consts, ct_xs, buffers

        ct_carry, ct_consts, ct_xs, _ = lax.fori_loop(
            0, n, reverse_step, (ct_carry, ct_consts, ct_xs, buffers)
        )
        carry_out_mask = [m and p for m, p in zip(vjp_step.carry_mask, perturbed["carry"])]
        ct_init = [ct if p else None
                   for ct, p in zip(vjp_step.full(ct_carry, vjp_step.carry_mask),
                                    carry_out_mask)]
        return (
            vjp_step.full(ct_consts, vjp_step.const_mask),
            ct_init,
            vjp_step.full(ct_xs, vjp_step.x_mask),
        )

    run.defvjp(run_fwd, run_bwd, symbolic_zeros=True)
    carry_out, ys = run(list(consts), carry_leaves, x_leaves)
    return (
        jax.tree_util.tree_unflatten(carry_def, carry_out),
        jax.tree_util.tree_unflatten(y_def, ys),
    )


def _schedule_arrays(sched: schedule_lib.Schedule) -> dict:
    return {
        "restore_slot": _int_array(sched.restore_slot),
        "restore_position": _int_array(sched.restore_position),
        "store_offsets": _int_array(sched.store_offsets),
        "store_position": _int_array(sched.store_position),
        "store_slot": _int_array(sched.store_slot),
        "n_stores": max(len(sched.store_position), 1),
    }


def _replay(arrays, k, r, buffers, advance, *, limit):
    """Restore the carry of reversed step k and advance it to step r, storing on the way.

    With ``limit`` (a traced trip count, for while_loop) steps at or past ``limit`` are
    identities: the advance stops at r if r < limit, else right after the last store
    this entry schedules before ``limit`` (later stores are never restored).
    """
    position = arrays["restore_position"][k]
    carry = _take(buffers, arrays["restore_slot"][k])
    first = arrays["store_offsets"][k]
    end = arrays["store_offsets"][k + 1]
    store_position = arrays["store_position"]
    store_slot = arrays["store_slot"]
    last = arrays["n_stores"] - 1

    def cond(state):
        i, _, _, pointer = state
        if limit is None:
            return i < r
        pending = (pointer < end) & (store_position[jnp.minimum(pointer, last)] < limit)
        return (i < r) & ((r < limit) | pending)

    def body(state):
        i, carry, buffers, pointer = state
        carry = advance(i, carry)
        slot_index = jnp.minimum(pointer, last)
        do = (pointer < end) & (store_position[slot_index] == i + 1)
        buffers = _store(buffers, carry, store_slot[slot_index], do)
        return i + 1, carry, buffers, pointer + do.astype(jnp.int32)

    _, carry, buffers, _ = lax.while_loop(cond, body, (position, carry, buffers, first))
    return carry, buffers


# --------------------------------------------------------------------------------------
# while_loop


def while_loop(
    cond_fun: Callable[[Any], Any],
    body_fun: Callable[[Any], Any],
    init: Any,
    *,
    max_steps: int,
    checkpoints: int | str | None = None,
) -> Any:
    """``jax.lax.while_loop`` that is reverse-differentiable with O(checkpoints) memory.

    Runs ``body_fun`` while ``cond_fun(carry)`` is true, at most ``max_steps`` times (the
    loop stops there, as Equinox's checkpointed loops do). Under ``jax.grad`` the forward
    pass stores carries at the positions of the binomial schedule for ``max_steps`` steps
    and the backward pass replays it, treating steps after termination as identities.

    Args:
      cond_fun: ``carry -> bool scalar``.
      body_fun: ``carry -> carry`` (same structure, shapes, dtypes); may close over
        arrays, which get gradients.
      init: initial carry.
      max_steps: bound on the trip count (the schedule is planned for it).
      checkpoints: as in :func:`scan`, for ``max_steps`` steps.

    Memory/compute: ``min(checkpoints, max_steps)`` carries. The forward pass evaluates
    the body N times (N = the actual trip count); the backward replays at most the
    ``max_steps`` schedule's recomputations that fall before N, plus one cheap loop
    iteration per schedule entry (``max_steps`` of them). When N is much smaller than
    ``max_steps``, a smaller ``max_steps`` gives a better schedule.

    Example::

        >>> import jax, jax.numpy as jnp, memwise as mw
        >>> def newton_steps(a):
        ...     x, _ = mw.while_loop(lambda s: s[1] < 20,
        ...                          lambda s: (0.5 * (s[0] + a / s[0]), s[1] + 1),
        ...                          (a, 0), max_steps=100, checkpoints=4)
        ...     return x
        >>> float(jax.grad(newton_steps)(4.0))  # d sqrt(a)/da = 1/(2 sqrt(a))
        0.25
    """
    _check_callable(cond_fun, "cond_fun")
    _check_callable(body_fun, "body_fun")
    if isinstance(max_steps, bool) or not isinstance(max_steps, (int, np.integer)):
        raise TypeError(f"max_steps must be an int >= 1, got {type(max_steps).__name__}")
    if max_steps < 1:
        raise ValueError(f"max_steps={max_steps} must be >= 1")
    max_steps = int(max_steps)
    init = _strong_carry(lambda c, _: (body_fun(c), None), init, None, name="body_fun")
    pred = jax.eval_shape(cond_fun, init)
    if getattr(pred, "shape", None) != () or pred.dtype != jnp.bool_:
        raise TypeError(
            f"cond_fun must return a boolean scalar, got {getattr(pred, 'dtype', pred)}"
            f"{list(getattr(pred, 'shape', []))}"
        )
    c = resolve_checkpoints(checkpoints, max_steps)
    sched = schedule_lib.binomial(max_steps, c)

    carry_leaves, carry_def = jax.tree_util.tree_flatten(init)

    def flat_body(leaves, _):
        out = body_fun(jax.tree_util.tree_unflatten(carry_def, leaves))
        return jax.tree_util.tree_leaves(out), []

    def flat_cond(leaves):
        return cond_fun(jax.tree_util.tree_unflatten(carry_def, leaves))

    body_conv, body_consts = jax.closure_convert(flat_body, carry_leaves, [])
    cond_conv, cond_consts = jax.closure_convert(flat_cond, carry_leaves)
    # The predicate is not differentiated: its closed-over arrays need no cotangent.
    cond_consts = [lax.stop_gradient(a) for a in cond_consts]
    _reject_forward_mode(list(body_consts) + carry_leaves, "memwise.while_loop")

    def step(carry, x, consts):
        return body_conv(carry, x, *consts)

    def keep_going(i, carry, cond_consts):
        return (i < max_steps) & cond_conv(carry, *cond_consts)

    @jax.custom_vjp
    def run(consts, cond_consts, carry):
        def body(state):
            i, carry = state
            return i + 1, step(carry, [], consts)[0]

        return lax.while_loop(
            lambda s: keep_going(s[0], s[1], cond_consts), body, (jnp.int32(0), carry)
        )[1]

    perturbed: dict = {}

    def run_fwd(consts, cond_consts, carry):
        consts, perturbed["consts"] = _primal_values(consts)
        cond_consts, _ = _primal_values(cond_consts)
        carry, perturbed["carry"] = _primal_values(carry)
        forward = jnp.asarray(np.asarray(sched.forward_positions, dtype=np.int32))
        n_forward = len(sched.forward_positions)
        buffers = [jnp.zeros((sched.n_slots,) + a.shape, a.dtype) for a in carry]

        def body(state):
            i, carry, buffers, stored = state
            slot = jnp.minimum(stored, n_forward - 1)
            do = (stored < n_forward) & (forward[slot] == i)
            buffers = _store(buffers, carry, slot, do)
            carry = step(carry, [], consts)[0]
            return i + 1, carry, buffers, stored + do.astype(jnp.int32)

        trips, carry, buffers, _ = lax.while_loop(
            lambda s: keep_going(s[0], s[1], cond_consts),
            body,
            (jnp.int32(0), carry, buffers, jnp.int32(0)),
        )
        return carry, (consts, buffers, trips)

    def run_bwd(residuals, ct_carry):
        consts, buffers, trips = residuals
        carry0 = [b[0] for b in buffers]
        vjp_step = _Differentiator(step, carry0, [], consts, [], perturbed["consts"])
        ct_carry = vjp_step.split(
            [_dense(ct, a) for ct, a in zip(ct_carry, carry0)], vjp_step.carry_mask
        )
        ct_consts = [jnp.zeros_like(a) for a in vjp_step.split(consts, vjp_step.const_mask)]
        arrays = _schedule_arrays(sched)

        def advance(i, carry):
            return step(carry, [], consts)[0]

        def reverse_step(k, state):
            ct_carry, ct_consts, buffers = state
            r = max_steps - 1 - k
            carry, buffers = _replay(arrays, k, r, buffers, advance, limit=trips)

            def taped(ct):
                ct_carry, ct_consts = ct
                ct_c, _, ct_k = vjp_step(carry, [], consts, ct_carry, [])
                return ct_c, [a + b for a, b in zip(ct_consts, ct_k)]

            ct_carry, ct_consts = lax.cond(
                r < trips, taped, lambda ct: ct, (ct_carry, ct_consts)
            )
            return ct_carry, ct_consts, buffers

        ct_carry, ct_consts, _ = lax.fori_loop(
            0, max_steps, reverse_step, (ct_carry, ct_consts, buffers)
        )
        ct_init = [ct if p else None
                   for ct, p in zip(vjp_step.full(ct_carry, vjp_step.carry_mask),
                                    perturbed["carry"])]
        return (
            vjp_step.full(ct_consts, vjp_step.const_mask),
            [None] * len(cond_consts),
            ct_init,
        )

    run.defvjp(run_fwd, run_bwd, symbolic_zeros=True)
    out = run(list(body_consts), list(cond_consts), carry_leaves)
    return jax.tree_util.tree_unflatten(carry_def, out)
