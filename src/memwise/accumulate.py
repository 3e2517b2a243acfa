"""Gradient accumulation: the gradient of a batch computed micro-batch by micro-batch.

The mean loss over a batch split into ``m`` equal micro-batches is the mean of the
micro-batch means, so its gradient is the mean of the micro-batch gradients. Computing
them one after the other inside one ``lax.scan`` holds the activations of one
micro-batch (batch / m examples) plus one running sum of the gradients, instead of the
activations of the whole batch: the standard trick of large-batch training (and of the
ViT fine-tuning code behind the neural-tangents issue 144 report,
``utils.accumulate_gradient``), here as one function that also averages across devices
(``lax.pmean`` over ``axis_name``) and whose micro-batch count ``fit`` can choose.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from memwise import knobs
from memwise._arguments import positive_int
from memwise._dtypes import accumulation_dtype
from memwise.sharding import check_divisible, devices, row_sharding, sharded_call

__all__ = ["accumulate_grad"]


def _batch_size(batch: Any) -> int:
    leaves = jax.tree_util.tree_leaves(batch)
    if not leaves:
        raise ValueError("batch has no array leaves; pass the examples, e.g. (images, labels)")
    sizes = {jnp.shape(leaf)[0] for leaf in leaves if jnp.ndim(leaf)}
    if any(jnp.ndim(leaf) == 0 for leaf in leaves) or len(sizes) != 1:
        shapes = [jnp.shape(leaf) for leaf in leaves]
        raise ValueError(
            f"every leaf of batch needs the same leading (example) axis, got shapes {shapes}"
        )
    n = sizes.pop()
    if n == 0:
        # A mean over no examples is NaN: raising beats a NaN loss that poisons training.
        raise ValueError(
            f"batch has no examples (leading axis 0, leaf shapes "
            f"{[jnp.shape(leaf) for leaf in leaves]}); pass at least one example"
        )
    return n


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _resolve_microbatches(microbatches: int | str, batch_size: int) -> int:
    if microbatches == "auto":
        candidates = _divisors(batch_size)
        # Same arithmetic for every count; more, smaller micro-batches cost loop steps
        # and lower device utilisation, modelled as a few percent per doubling.
        return knobs.auto(
            "microbatches",
            candidates=candidates,
            cost=lambda m: 1.0 + 0.03 * math.log2(m),
            default=1,
        )
    microbatches = positive_int(microbatches, "microbatches", accepts=" or 'auto'")
    if batch_size % microbatches:
        near = [d for d in _divisors(batch_size) if d <= microbatches][-1]
        raise ValueError(
            f"a batch of {batch_size} examples does not split into microbatches="
            f"{microbatches} equal micro-batches; choose a divisor of {batch_size} "
            f"(e.g. {near}) or pad the batch to a multiple of {microbatches}"
        )
    return microbatches


def accumulate_grad(
    loss_fn: Callable[..., Any],
    params: Any,
    batch: Any,
    *,
    microbatches: int | str,
    axis_name: str | None = None,
    has_aux: bool = False,
) -> tuple[Any, Any]:
    """``jax.value_and_grad(loss_fn)(params, batch)`` computed in micro-batches.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar`` (``(scalar, aux)`` with ``has_aux``),
        the *mean* loss over the examples of ``batch``.
      params: the pytree to differentiate.
      batch: a pytree of arrays sharing a leading example axis of size ``n``.
      microbatches: how many equal micro-batches to split ``n`` into (must divide ``n``),
        or ``"auto"`` (1 outside :func:`memwise.fit`, which picks the count that fits).
      axis_name: when given (inside ``pmap``/``shard_map``), loss and gradients are
        averaged over that axis with ``lax.pmean``. Without it, a ``batch`` split over
        devices (its ``NamedSharding``, an Explicit-axes type, or a mesh with Auto axes,
        as for :func:`memwise.pairwise_reduce`) runs data parallel: each device
        accumulates ``microbatches`` micro-batches of its own examples, ``params`` whole
        on every device, then one ``pmean`` (aux then stacks D x ``microbatches``).
      has_aux: ``loss_fn`` returns ``(loss, aux)``; aux is returned stacked over the
        micro-batches (a leading axis of size ``microbatches``).

    Returns:
      ``(loss, grads)`` (``((loss, aux), grads)`` with ``has_aux``): the mean loss and its
      gradient over the whole batch, equal to the full-batch values up to rounding.

    Raises:
      ValueError: ``batch`` has no examples (the mean loss over none is undefined; a
        dense ``jnp.mean`` would give NaN), or ``microbatches`` does not divide them.

    Memory and compute: one micro-batch's activations at a time plus one gradient-sized
    accumulator, for the same arithmetic as the full batch run in ``microbatches``
    sequential steps. The accumulator is at least float32 (twice the gradient's bytes
    for bfloat16/float16 parameters); loss and gradients are returned in their own dtypes.

    Example::

        >>> import jax.numpy as jnp, memwise as mw
        >>> def loss_fn(w, batch):
        ...     x, y = batch
        ...     return jnp.mean((x @ w - y) ** 2)
        >>> w, x, y = jnp.ones(3), jnp.ones((8, 3)), jnp.zeros(8)
        >>> loss, grad = mw.accumulate_grad(loss_fn, w, (x, y), microbatches=4)
        >>> float(loss)
        9.0
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable loss_fn(params, batch), got {loss_fn!r}")
    n = _batch_size(batch)
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if not jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
            raise TypeError(
                f"params{jax.tree_util.keystr(path)} has dtype {jnp.result_type(leaf)}: "
                "every leaf of params is differentiated, so each must be a float array; "
                "keep integer state (step counters) out of params, e.g. in a closure"
            )
    split = None if axis_name is not None else row_sharding(batch, None, None, "batch")
    if split is not None:
        # Data parallel: every device accumulates over its own examples, then one pmean.
        mesh, axes = split
        check_divisible(n, mesh, axes, "batch")
        local_n = n // devices(mesh, axes)
        count = _resolve_microbatches(microbatches, local_n)

        def local(params, batch):
            return accumulate_grad(
                loss_fn, params, batch, microbatches=count, axis_name=axes, has_aux=has_aux
            )

        # aux: every device's micro-batches, device by device (D x microbatches).
        out_specs = ((P(), P(axes)), P()) if has_aux else (P(), P())
        return sharded_call(local, mesh, (P(), P(axes)), out_specs, params, batch)
    count = _resolve_microbatches(microbatches, n)
    size = n // count
    stacked = jax.tree_util.tree_map(lambda a: jnp.reshape(a, (count, size) + a.shape[1:]), batch)
    value_and_grad = jax.value_and_grad(loss_fn, has_aux=has_aux)

    def step(carry, micro_batch):
        loss_sum, grad_sum = carry
        value, grads = value_and_grad(params, micro_batch)
        loss, aux = value if has_aux else (value, None)
        grad_sum = jax.tree_util.tree_map(lambda s, g: s + g.astype(s.dtype), grad_sum, grads)
        return (loss_sum + loss.astype(loss_sum.dtype), grad_sum), aux

    loss_shape = jax.eval_shape(
        lambda: value_and_grad(params, jax.tree_util.tree_map(lambda a: a[0], stacked))
    )
    (loss_struct, _), grad_struct = (
        loss_shape if has_aux else ((loss_shape[0], None), loss_shape[1])
    )
    if loss_struct.shape != ():
        raise TypeError(f"loss_fn must return a scalar loss, got shape {loss_struct.shape}")
    # Sums over micro-batches in at least float32: bfloat16 ones round away most of each
    # addend once the sum is large.
    zeros = jax.tree_util.tree_map(
        lambda s: jnp.zeros(s.shape, accumulation_dtype(s.dtype)), grad_struct
    )
    init = (jnp.zeros((), accumulation_dtype(loss_struct.dtype)), zeros)
    (loss_sum, grad_sum), aux = lax.scan(step, init, stacked)
    loss = loss_sum / count
    grads = jax.tree_util.tree_map(lambda g: g / count, grad_sum)
    if axis_name is not None:
        loss, grads = lax.pmean((loss, grads), axis_name)
    loss = loss.astype(loss_struct.dtype)
    grads = jax.tree_util.tree_map(lambda g, s: g.astype(s.dtype), grads, grad_struct)
    return ((loss, aux), grads) if has_aux else (loss, grads)
