"""Flax adapters for :func:`memwise.scan`: a linen lifted scan and an NNX helper.

Flax's ``nn.scan`` runs ``jax.lax.scan``, so ``jax.grad`` of a recurrent model keeps one
carry (and one step's residuals) per step, even with ``nn.remat`` on the cell (the Flax
LSTM over 10,000 steps in the ``nn.remat`` discussion). :func:`scan` has the calling
convention of ``nn.scan`` for the usual recurrent case (``variable_broadcast="params"``, ``split_rngs={"params":
False}``, ``in_axes``, ``out_axes``) and runs the loop with ``memwise.scan`` and its
optimal binomial checkpointing (Griewank & Walther 2000), so the fix is one line::

    @functools.partial(mw.flax.scan, variable_broadcast="params",
                       in_axes=1, out_axes=1,
                       split_rngs={"params": False}, checkpoints=16)
    def forward(self, carry, x):
        return self.cell(carry, x)

Broadcast variables (the parameters) are closed over by the loop body and receive their
gradients through ``memwise.scan``'s closure conversion. While those collections are
mutable (``Module.init``) the loop is Flax's own ``nn.scan``, which creates the shared
parameters; no gradient is taken there. RNG streams listed in ``split_rngs`` with ``True``
are split per step and scanned, so replayed steps see the same randomness.

For NNX, :func:`scan_module` scans ``f(module, carry, x)`` with the module's state
broadcast. Equinox needs no adapter: modules are pytrees, close over them in the body.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from memwise.scan import scan as _mw_scan

__all__ = ["scan", "scan_module"]


def _collections(filter_: Any) -> tuple[str, ...]:
    if isinstance(filter_, str):
        return (filter_,)
    if isinstance(filter_, (tuple, list)) and all(isinstance(c, str) for c in filter_):
        return tuple(filter_)
    raise TypeError(
        f"variable_broadcast must be a collection name or a tuple of names, got {filter_!r}"
    )


def _core_scan(
    fn: Callable[..., Any],
    *,
    variable_broadcast: Any,
    split_rngs: Mapping[str, bool],
    in_axes: Any,
    out_axes: Any,
    length: int | None,
    reverse: bool,
    unroll: int,
    checkpoints: Any,
    schedule: str,
) -> Callable[..., Any]:
    from flax.core import axes_scan, lift
    from flax.core.scope import PRNGSequenceFilter

    broadcast_collections = _collections(variable_broadcast)
    rng_filters = tuple(split_rngs.keys())
    rng_splits = tuple(bool(split_rngs[k]) for k in rng_filters)
    # Keyed by flax's PRNG stream filters, of which a stream name is one kind.
    rng_filter_splits: dict[PRNGSequenceFilter, bool] = {k: s for k, s in split_rngs.items()}
    flax_scan = lift.scan(
        fn,
        variable_broadcast=variable_broadcast,
        split_rngs=rng_filter_splits,
        in_axes=in_axes,
        out_axes=out_axes,
        length=length,
        reverse=reverse,
        unroll=unroll,
    )

    def axes_for(args):
        axes = in_axes if isinstance(in_axes, (tuple, list)) else (in_axes,) * len(args)
        if len(axes) != len(args):
            raise ValueError(f"in_axes has {len(axes)} entries for {len(args)} scanned arguments")
        for axis in axes:
            if axis is not axes_scan.broadcast and not isinstance(axis, int):
                raise TypeError(
                    f"in_axes entries must be ints or nn.broadcast (one per argument), got {axis!r}"
                )
        return axes

    def inner(scope_fn, repack_fn, variable_groups, rng_groups, init, *args):
        axes = axes_for(args)
        scanned = tuple(
            None
            if axis is axes_scan.broadcast
            else jax.tree_util.tree_map(lambda a, ax=axis: jnp.moveaxis(a, ax, 0), arg)
            for arg, axis in zip(args, axes)
        )
        lengths = {leaf.shape[0] for leaf in jax.tree_util.tree_leaves(scanned)}
        if len(lengths) > 1:
            raise ValueError(f"scanned arguments have different lengths {sorted(lengths)}")
        n = length if length is not None else (lengths.pop() if lengths else None)
        if n is None:
            raise ValueError("nothing is scanned over: pass length=")
        split = tuple(
            lift.tree_map_rngs(lambda rng: jax.random.split(jax.random.clone(rng), n), group)
            if do_split
            else None
            for group, do_split in zip(rng_groups, rng_splits)
        )

        def body(carry, step_inputs):
            step_args, step_rngs = step_inputs
            full_args = [
                arg if axis is axes_scan.broadcast else step_arg
                for arg, step_arg, axis in zip(args, step_args, axes)
            ]
            rngs = tuple(
                step if do_split else group
                for group, step, do_split in zip(rng_groups, step_rngs, rng_splits)
            )
            scope = scope_fn(variable_groups, rngs)
            carry, y = fn(scope, carry, *full_args)
            repack_fn(scope)
            return carry, y

        carry, ys = _mw_scan(
            body,
            init,
            (scanned, split),
            length=n,
            checkpoints=checkpoints,
            schedule=schedule,
            reverse=reverse,
            unroll=unroll,
        )
        if not isinstance(out_axes, int):
            raise TypeError(f"out_axes must be an int, got {out_axes!r}")
        ys = jax.tree_util.tree_map(lambda a: jnp.moveaxis(a, 0, out_axes), ys)
        return (carry, ys), variable_groups

    packed = lift.pack(
        inner, (variable_broadcast,), (variable_broadcast,), rng_filters, name="scan"
    )

    def wrapper(scope, init, *args):
        # linen passes one scope per module the method touches (a list)
        scopes = scope if isinstance(scope, (list, tuple)) else [scope]
        if any(s.is_mutable_collection(c) for s in scopes for c in broadcast_collections):
            return flax_scan(scope, init, *args)  # init: creates the shared variables
        return packed(scope, init, *args)

    return wrapper


def scan(
    target: Any,
    *,
    variable_broadcast: Any = "params",
    split_rngs: Mapping[str, bool] | None = None,
    in_axes: Any = 0,
    out_axes: int = 0,
    length: int | None = None,
    reverse: bool = False,
    unroll: int = 1,
    checkpoints: int | str | None = None,
    schedule: str = "binomial",
    methods: Any = None,
) -> Any:
    """``flax.linen.scan`` for recurrent models, run by :func:`memwise.scan`.

    Args:
      target: a ``Module`` class or a method (use as a decorator, like ``nn.scan``).
      variable_broadcast: collections shared by all steps (``"params"``).
      split_rngs: ``{stream: split}``; split streams get a fresh key per step.
        Default ``{"params": False}``.
      in_axes: per scanned argument, the axis to scan over or ``nn.broadcast``.
      out_axes: axis of the stacked outputs.
      length: as in ``nn.scan``.
      reverse: as in ``nn.scan``.
      unroll: as in ``nn.scan``.
      checkpoints: as in :func:`memwise.scan`.
      schedule: as in :func:`memwise.scan`.
      methods: module methods to scan when ``target`` is a class.

    Memory/compute: under ``jax.grad`` the loop keeps ``checkpoints`` carries instead of
    one per step, for ``memwise.schedule.evaluations(n, checkpoints)`` cell calls.

    Example::

        >>> import functools, jax, jax.numpy as jnp, flax.linen as nn, memwise.flax
        >>> class LSTM(nn.Module):
        ...     @functools.partial(memwise.flax.scan, variable_broadcast="params",
        ...                        split_rngs={"params": False},
        ...                        in_axes=1, out_axes=1, checkpoints=8)
        ...     @nn.compact
        ...     def __call__(self, carry, x):
        ...         return nn.OptimizedLSTMCell(16)(carry, x)
        >>> x = jnp.ones((2, 50, 3)); c = (jnp.zeros((2, 16)), jnp.zeros((2, 16)))
        >>> params = LSTM().init(jax.random.PRNGKey(0), c, x)
        >>> (c, ys) = LSTM().apply(params, c, x); ys.shape
        (2, 50, 16)
    """
    import flax.linen as nn

    return nn.transforms.lift_transform(
        _core_scan,
        target,
        variable_broadcast=variable_broadcast,
        split_rngs=dict(split_rngs) if split_rngs is not None else {"params": False},
        in_axes=in_axes,
        out_axes=out_axes,
        length=length,
        reverse=reverse,
        unroll=unroll,
        checkpoints=checkpoints,
        schedule=schedule,
        methods=methods,
    )


def scan_module(
    f: Callable[[Any, Any, Any], tuple[Any, Any]],
    module: Any,
    init: Any,
    xs: Any = None,
    length: int | None = None,
    **scan_kwargs: Any,
) -> tuple[Any, Any]:
    """Scan ``f(module, carry, x) -> (carry, y)`` over xs with an NNX module broadcast.

    The module's state is read-only inside the loop (a checkpointed loop replays steps,
    so state updates such as RNG counters or batch statistics would be applied several
    times: a ``ValueError`` says so). Its parameters get gradients under ``nnx.grad`` or
    ``jax.grad``. ``scan_kwargs`` are those of :func:`memwise.scan`.

    Example::

        >>> import jax.numpy as jnp, flax.nnx as nnx, memwise.flax
        >>> cell = nnx.OptimizedLSTMCell(3, 16, rngs=nnx.Rngs(0))
        >>> carry = (jnp.zeros((2, 16)), jnp.zeros((2, 16)))
        >>> def loss(cell):
        ...     _, ys = memwise.flax.scan_module(
        ...         lambda m, c, x: m(c, x), cell, carry, jnp.ones((50, 2, 3)),
        ...         checkpoints=8)
        ...     return ys.sum()
        >>> grads = nnx.jit(nnx.grad(loss))(cell)
        >>> grads.dense_i.kernel.shape, grads.dense_h.kernel.shape
        ((3, 64), (16, 64))
    """
    import flax.errors
    from flax import nnx

    graphdef, state = nnx.split(module)
    before = jax.tree_util.tree_leaves(state)

    message = (
        "f changed the module's state inside memwise.flax.scan_module; a checkpointed "
        "loop replays steps, so module state must be read-only. Keep mutable state (RNG "
        "streams, batch statistics, counters) in the carry instead"
    )

    def body(carry, x):
        local = nnx.merge(graphdef, state)
        try:
            carry, y = f(local, carry, x)
        except flax.errors.TraceContextError as error:  # NNX refuses the write itself
            raise ValueError(message) from error
        after = jax.tree_util.tree_leaves(nnx.state(local))
        if len(after) != len(before) or any(a is not b for a, b in zip(after, before)):
            raise ValueError(message)
        return carry, y

    return _mw_scan(body, init, xs, length, **scan_kwargs)
