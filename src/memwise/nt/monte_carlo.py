"""neural-tangents' ``nt.monte_carlo_kernel_fn``: kernels averaged over random initialisations.

The mean over ``n_samples`` initialisations of a finite network's empirical NNGP and NTK
(:mod:`memwise.nt.empirical`); as the widths grow it converges to the infinite-width
kernel (Jacot et al. 2018; Novak et al. 2019), which is how neural-tangents' tests hold
each layer's ``kernel_fn`` to its ``init_fn``/``apply_fn``. Keys are drawn as
neural-tangents draws them (one ``random.split`` per sample, then ``(init, dropout)``),
so with the same ``init_fn`` the same parameters are sampled.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
from jax import random

from memwise._arguments import positive_int
from memwise.nt.batching import batch
from memwise.nt.empirical import NtkImplementation, empirical_kernel_fn

__all__ = ["monte_carlo_kernel_fn"]


def monte_carlo_kernel_fn(
    init_fn: Callable,
    apply_fn: Callable,
    key: jax.Array,
    n_samples: int | Iterable[int],
    batch_size: int = 0,
    device_count: int = -1,
    store_on_device: bool = True,
    trace_axes: Any = (-1,),
    diagonal_axes: Any = (),
    vmap_axes: Any = None,
    implementation: NtkImplementation | int = NtkImplementation.JACOBIAN_CONTRACTION,
    _j_rules: bool = True,
    _s_rules: bool = True,
    _fwd: bool | None = None,
) -> Callable:
    """``kernel_fn(x1, x2=None, get=None)``: the empirical kernels averaged over inits.

    Args:
      init_fn: the finite network's initialisation (e.g. a :mod:`memwise.nt.stax`
        layer's).
      apply_fn: the finite network.
      key: the PRNG key the initialisations are drawn from.
      n_samples: the number of initialisations; an iterable of counts makes
        ``kernel_fn`` a generator of the running means at those counts.
      batch_size: as :func:`memwise.nt.batch`.
      device_count: as :func:`memwise.nt.batch`.
      store_on_device: as :func:`memwise.nt.batch`.
      trace_axes: as :func:`memwise.nt.empirical_kernel_fn`.
      diagonal_axes: as :func:`memwise.nt.empirical_kernel_fn`.
      vmap_axes: as :func:`memwise.nt.empirical_kernel_fn`.
      implementation: as :func:`memwise.nt.empirical_kernel_fn`.
      _j_rules: accepted and without effect, as in :func:`memwise.nt.empirical_ntk_fn`.
      _s_rules: as ``_j_rules``.
      _fwd: as ``_j_rules``.

    Returns:
      ``kernel_fn(x1, x2=None, get=None)``: the averaged kernel(s) (``get`` as in
      :func:`memwise.nt.empirical_kernel_fn`), or a generator for several counts.

    Raises:
      TypeError, ValueError: ``n_samples`` not a positive int or an iterable of them.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> import memwise.nt as nt
        >>> from memwise.nt import stax
        >>> init_fn, apply_fn, _ = stax.serial(
        ...     stax.Dense(64), stax.Relu(), stax.Dense(1))
        >>> mc = nt.monte_carlo_kernel_fn(
        ...     init_fn, apply_fn, jax.random.PRNGKey(0), 4)
        >>> mc(jnp.ones((3, 2)), None, "nngp").shape
        (3, 3)
    """
    counts = set(n_samples) if isinstance(n_samples, Iterable) else {n_samples}
    for n in counts or [n_samples]:  # an empty iterable is refused like a bad count
        positive_int(n, "n_samples", accepts=" or an iterable of them")
    generator = isinstance(n_samples, Iterable)
    kernel_fn = empirical_kernel_fn(apply_fn, trace_axes, diagonal_axes, vmap_axes, implementation)

    def sample_once(x1: Any, x2: Any, one_key: jax.Array, get: Any) -> Any:
        init_key, _ = random.split(one_key)
        _, params = init_fn(init_key, jax.tree.map(lambda x: x.shape, x1))
        return kernel_fn(x1, x2, get, params)

    def running_means(x1: Any, x2: Any, get: Any) -> Iterator[tuple[int, Any]]:
        once = batch(
            jax.jit(sample_once, static_argnums=3), batch_size, device_count, store_on_device
        )
        total, k = None, key
        for n in range(1, max(counts) + 1):
            k, split = random.split(k)
            sample = once(x1, x2, split, get)
            total = sample if total is None else jax.tree.map(lambda a, b: a + b, total, sample)
            if n in counts:
                yield n, jax.tree.map(lambda a, n=n: a / n, total)

    def mean_kernel_fn(x1: Any, x2: Any = None, get: Any = None) -> Any:
        if generator:
            return (mean for _, mean in running_means(x1, x2, get))
        *_, (_, mean) = running_means(x1, x2, get)
        return mean

    return mean_kernel_fn
