"""neural-tangents' ``nt.predict``: closed-form training dynamics and GP inference.

The functions of neural-tangents 0.6.5's ``predict`` module (Lee et al. 2019, "Wide
neural networks of any depth evolve as linear models under gradient descent"; Novak et
al. 2020), with its arguments and defaults:

* :func:`gradient_descent_mse_ensemble`: the mean (and covariance) of an infinite
  ensemble trained on MSE for time ``t``, computed by :func:`memwise.ntk.predict` (the
  test-by-train kernel in tiles, never held for the mean);
* :func:`gradient_descent_mse`: the outputs of one network under gradient flow, from
  given kernel matrices;
* :func:`gp_inference`: the NNGP / NTK posterior from given kernel matrices.

The matrix versions use :mod:`memwise.ntk.predict`'s propagator (a Cholesky solve for
infinite time, the eigendecomposition for finite times). Supported: 2-D kernel matrices
(the default ``trace_axes=(-1,)``: one kernel shared by every output) and targets of shape
(n, outputs). Kernels with output axes (``trace_axes=()``) and kernel keyword arguments
raise ``NotImplementedError`` naming them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from memwise.engine import accumulation_dtype
from memwise.nt._triple import KernelFn as _CompatKernelFn
from memwise.nt._triple import named_tuple
from memwise.ntk._gradient_flow import Propagator, check_time
from memwise.ntk.predict import predict as _predict

__all__ = [
    "Gaussian",
    "gp_inference",
    "gradient_descent",
    "gradient_descent_mse",
    "gradient_descent_mse_ensemble",
    "max_learning_rate",
]


class Gaussian(NamedTuple):
    """A Gaussian's ``mean`` and ``covariance``, as neural-tangents' ``predict.Gaussian``."""

    mean: jax.Array
    covariance: jax.Array


def _check_trace_axes(trace_axes: Any, y_train: jax.Array) -> None:
    axes = [trace_axes] if isinstance(trace_axes, int) else list(trace_axes)
    if [a % y_train.ndim for a in axes] != [y_train.ndim - 1]:
        raise NotImplementedError(
            f"trace_axes={trace_axes!r} (kernels with output axes) is not supported by "
            "memwise.nt.predict; use trace_axes=(-1,), one kernel shared by every output"
        )


def _check_targets(y_train: Any) -> jax.Array:
    y = jnp.asarray(y_train)
    if y.ndim != 2:
        raise ValueError(f"y_train must be (n, outputs), got shape {y.shape}")
    return y


def _check_matrix(k: Any, name: str, n: int | None = None) -> jax.Array:
    k = jnp.asarray(k)
    if k.ndim != 2:
        raise NotImplementedError(
            f"{name} of shape {k.shape}: memwise.nt.predict takes 2-D kernel matrices "
            "(trace_axes=(-1,))"
        )
    if n is not None and k.shape[1] != n:
        raise ValueError(f"{name} must have {n} columns (the training inputs), got {k.shape}")
    return k


def _full_kernel(trace_axes: Any, y: jax.Array, k: Any) -> bool:
    """``trace_axes=()`` with (n, n, O, O) kernels: the full kernel, flattened."""
    axes = [trace_axes] if isinstance(trace_axes, int) else list(trace_axes)
    return not axes and jnp.ndim(k) == 4


def _as_matrix(k: Any, name: str, n: int, full: bool) -> jax.Array:
    """A kernel as the matrix the solves take: (n1, n2, O, O) -> (n1 O, n2 O) when full."""
    if not full:
        return _check_matrix(k, name, n)
    k = jnp.asarray(k)
    if k.ndim != 4 or k.shape[1] != n:
        raise ValueError(
            f"{name} must be (m, {n}, outputs, outputs) with trace_axes=(), got {k.shape}"
        )
    m, _, o1, o2 = k.shape
    return jnp.transpose(k, (0, 2, 1, 3)).reshape(m * o1, n * o2)


def _relative_ridge(k: jax.Array, diag_reg: float, absolute: bool) -> Any:
    """neural-tangents' ``diag_reg`` as memwise's ``ridge`` (relative to the mean diagonal)."""
    if not absolute:
        return diag_reg
    return diag_reg / (jnp.trace(k) / k.shape[0])


def _gets(get: Any, known: tuple[str, ...] = ("nngp", "ntk")) -> tuple[tuple[str, ...], bool]:
    gets = ("nngp", "ntk") if get is None else (get,) if isinstance(get, str) else tuple(get)
    gets = tuple(g.lower() if isinstance(g, str) else g for g in gets)  # "NTK" as upstream
    if not gets or any(g not in known for g in gets):
        raise ValueError(f"get must be one of {known}, a tuple of them or None, got {get!r}")
    return gets, isinstance(get, str)


def _named(values: dict, gets: Sequence[str], single: bool) -> Any:
    if single:
        return values[gets[0]]
    return named_tuple("Gaussians", gets)(*(values[g] for g in gets))


def gradient_descent_mse(
    k_train_train: jax.Array,
    y_train: jax.Array,
    learning_rate: float = 1.0,
    diag_reg: float = 0.0,
    diag_reg_absolute_scale: bool = False,
    trace_axes: Any = (-1,),
) -> Callable:
    """``predict_fn(t, fx_train_0, fx_test_0, k_test_train)``: one network's outputs
    under gradient flow on MSE, as ``nt.predict.gradient_descent_mse``.

    ``f_train(t) = y + exp(-Theta t / N) (f_train(0) - y)`` and ``f_test(t) = f_test(0)
    + Theta(x, X) Theta^-1 (I - exp(-Theta t / N)) (y - f_train(0))``, with ``Theta``
    the regularised ``k_train_train`` and ``N = y_train.size``; ``t`` a scalar or an
    array of times (leading result axes), ``None`` infinite time.

    Returns ``f_train(t)`` when ``fx_test_0 is None``, ``f_test(t)`` when
    ``fx_train_0 is None``, else both.

    Example::

        >>> import jax.numpy as jnp
        >>> import memwise.nt as nt
        >>> k = jnp.array([[2.0, 0.5], [0.5, 1.0]]); y = jnp.array([[1.0], [-1.0]])
        >>> predict_fn = nt.predict.gradient_descent_mse(k, y)
        >>> predict_fn(None, 0.0, 0.0, jnp.array([[1.0, 0.2]]))[1].shape
        (1, 1)
    """
    y = _check_targets(y_train)
    full = _full_kernel(trace_axes, y, k_train_train)
    if not full:
        _check_trace_axes(trace_axes, y)
    k = _as_matrix(k_train_train, "k_train_train", y.shape[0], full)
    wide = accumulation_dtype(jnp.result_type(k.dtype, y.dtype))
    ridge = _relative_ridge(k, diag_reg, diag_reg_absolute_scale)
    k = k.astype(wide)
    n_outputs = 1 if full else y.shape[1]
    # With the full kernel (trace_axes=()), outputs are rows of the (n * O, n * O) matrix.
    flat = (lambda a: a.reshape(a.shape[:-2] + (-1, 1))) if full else (lambda a: a)
    unflat = (lambda a: a.reshape(a.shape[:-2] + (-1, y.shape[1]))) if full else (lambda a: a)

    def predict_fn(
        t: Any = None,
        fx_train_0: Any = 0.0,
        fx_test_0: Any = None,
        k_test_train: Any = None,
    ) -> Any:
        if fx_test_0 is not None and k_test_train is None:
            raise ValueError("k_test_train is needed to predict the test outputs (fx_test_0)")
        residual = y.astype(wide) if fx_train_0 is None else y.astype(wide) - fx_train_0
        rhs = flat(residual)
        k_td = (
            None
            if k_test_train is None
            else _as_matrix(k_test_train, "k_test_train", y.shape[0], full).astype(wide)
        )
        if t is None:
            propagate = Propagator(k, ridge, None, n_outputs)
            fx_train_t = y.astype(k.dtype)
            if fx_test_0 is None or k_td is None:
                return fx_train_t
            fx_test_t = fx_test_0 + unflat(k_td @ propagate(rhs))
            return fx_test_t if fx_train_0 is None else (fx_train_t, fx_test_t)
        times = jnp.asarray(t, wide) * learning_rate
        propagate = Propagator(k, ridge, 1.0, n_outputs)
        theta = propagate.evecs @ (propagate.evals[:, None] * propagate.evecs.T)
        gains = jax.vmap(lambda s: propagate(rhs, time_scale=s))(times.reshape(-1))
        out = []
        if fx_train_0 is not None:
            train = fx_train_0 + unflat(jnp.einsum("ij,tjk->tik", theta, gains))
            out.append(train.reshape(times.shape + train.shape[1:]))
        if fx_test_0 is not None:
            test = fx_test_0 + unflat(jnp.einsum("ij,tjk->tik", k_td, gains))
            out.append(test.reshape(times.shape + test.shape[1:]))
        return out[0] if len(out) == 1 else tuple(out)

    return predict_fn


def _attr(k: Any, g: str, name: str) -> jax.Array:
    if hasattr(k, g):
        return getattr(k, g)
    if isinstance(k, dict) and g in k:
        return k[g]
    if isinstance(k, (jax.Array, np.ndarray)):
        return jnp.asarray(k)
    raise ValueError(f"{name} must be an array or have a {g!r} field, got {type(k).__name__}")


def gp_inference(
    k_train_train: Any,
    y_train: jax.Array,
    diag_reg: float = 0.0,
    diag_reg_absolute_scale: bool = False,
    trace_axes: Any = (-1,),
) -> Callable:
    """``predict_fn(get, k_test_train, k_test_test)``: the NNGP / NTK-GD posterior, as
    ``nt.predict.gp_inference``.

    ``k_train_train`` and ``k_test_train`` are arrays or namedtuples with ``nngp`` /
    ``ntk`` fields (``kernel_fn(x, y, ("nngp", "ntk"))``). Without ``k_test_test`` the
    means; with it ``Gaussian(mean, covariance)`` (the NTK covariance needs both kernels).

    Example::

        >>> import jax, jax.numpy as jnp
        >>> import memwise.nt as nt
        >>> from memwise.nt import stax
        >>> _, _, kernel_fn = stax.serial(
        ...     stax.Dense(512, b_std=0.1), stax.Erf(), stax.Dense(1))
        >>> x, x_test = jnp.linspace(-1, 1, 8)[:, None], jnp.array([[0.3]])
        >>> predict_fn = nt.predict.gp_inference(
        ...     kernel_fn(x, None, ("nngp", "ntk")), jnp.sin(x), diag_reg=1e-4)
        >>> predict_fn("nngp", kernel_fn(x_test, x, ("nngp", "ntk"))).shape
        (1, 1)
    """
    y = _check_targets(y_train)
    _check_trace_axes(trace_axes, y)

    def propagator(g: str) -> Propagator:
        k = _check_matrix(_attr(k_train_train, g, "k_train_train"), "k_train_train", y.shape[0])
        wide = accumulation_dtype(jnp.result_type(k.dtype, y.dtype))
        ridge = _relative_ridge(k, diag_reg, diag_reg_absolute_scale)
        return Propagator(k.astype(wide), ridge, None, y.shape[1])

    def predict_fn(get: Any = None, k_test_train: Any = None, k_test_test: Any = None) -> Any:
        gets, single = _gets(get, ("nngp", "ntk", "ntkgp"))
        out = {}
        for g in gets:
            kernel = "ntk" if g == "ntkgp" else g  # the NTK-GP: the NTK as a GP's kernel
            solve = propagator(kernel)
            k_dd = _attr(k_train_train, kernel, "k_train_train")
            wide = solve.factor[0].dtype
            if k_test_train is None:
                mean = y.astype(jnp.asarray(k_dd).dtype)
                out[g] = mean if k_test_test is None else Gaussian(mean, jnp.zeros_like(k_dd))
                continue
            k_td = _attr(k_test_train, kernel, "k_test_train")
            k_td = _check_matrix(k_td, "k_test_train", y.shape[0]).astype(wide)
            mean = k_td @ solve(y.astype(wide))
            if k_test_test is None:
                out[g] = mean
                continue
            if g == "ntk" and not (
                hasattr(k_train_train, "nngp") and hasattr(k_test_train, "nngp")
            ):
                raise ValueError(
                    "the NTK posterior covariance needs both the NTK and the NNGP: pass "
                    "k_train_train and k_test_train with nngp and ntk fields"
                )
            prior = "ntk" if g == "ntkgp" else "nngp"
            k_tt = jnp.asarray(_attr(k_test_test, prior, "k_test_test")).astype(wide)
            prior_td = jnp.asarray(_attr(k_test_train, prior, "k_test_train")).astype(wide)
            if g in ("nngp", "ntkgp"):
                cov = k_tt - k_td @ solve(prior_td.T)
            else:
                term_1 = solve(k_td.T)  # (n, m)
                nngp_dd = jnp.asarray(k_train_train.nngp).astype(wide)
                term_2 = k_td @ solve(prior_td.T)
                cov = term_1.T @ nngp_dd @ term_1 - (term_2 + term_2.T) + k_tt
            out[g] = Gaussian(mean, cov)
        return _named(out, gets, single)

    return predict_fn


def gradient_descent_mse_ensemble(
    kernel_fn: Callable,
    x_train: jax.Array,
    y_train: jax.Array,
    learning_rate: float = 1.0,
    diag_reg: float = 0.0,
    diag_reg_absolute_scale: bool = False,
    trace_axes: Any = (-1,),
    **kernel_fn_train_train_kwargs: Any,
) -> Callable:
    """``predict_fn(t, x_test, get, compute_cov)``: the infinite ensemble's test outputs
    after training time ``t``, as ``nt.predict.gradient_descent_mse_ensemble``.

    Computed by :func:`memwise.ntk.predict` (``ridge=diag_reg``, time ``t *
    learning_rate``), the kernels in tiles; for an array ``t`` every kernel and the
    eigendecomposition are computed once for all times.
    Returns the mean, or ``Gaussian(mean, covariance)`` with ``compute_cov=True``;
    for a tuple ``get`` (or ``None``) a ``Gaussians`` namedtuple of them.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> import memwise.nt as nt
        >>> from memwise.nt import stax
        >>> _, _, kernel_fn = stax.serial(
        ...     stax.Dense(512, b_std=0.1), stax.Relu(), stax.Dense(1))
        >>> x = jnp.linspace(-1, 1, 8)[:, None]
        >>> predict_fn = nt.predict.gradient_descent_mse_ensemble(
        ...     kernel_fn, x, jnp.sin(x), diag_reg=1e-4)
        >>> predict_fn(
        ...     t=10.0, x_test=x[:3], get="ntk", compute_cov=True).covariance.shape
        (3, 3)
    """
    if kernel_fn_train_train_kwargs:
        raise NotImplementedError(
            f"kernel_fn keyword arguments {sorted(kernel_fn_train_train_kwargs)} are not "
            "supported by memwise.nt.predict; close over them in kernel_fn"
        )
    if diag_reg_absolute_scale:
        raise NotImplementedError(
            "gradient_descent_mse_ensemble(diag_reg_absolute_scale=True) is not supported by "
            "memwise.nt; pass diag_reg relative to the mean diagonal of the training kernel"
        )
    y = _check_targets(y_train)
    _check_trace_axes(trace_axes, y)
    # The stax kernel's memwise KernelFn: evaluated in two steps, each input's variances once.
    kernel = kernel_fn.kernel if isinstance(kernel_fn, _CompatKernelFn) else kernel_fn

    # Compiled once per predictor, output kind and input shape: a call with another
    # time reuses it (eagerly, each call traced and compiled every tiled loop again).
    @functools.partial(jax.jit, static_argnames=("g", "compute_cov"))
    def one(t: Any, x_test: Any, g: str, compute_cov: bool) -> Any:
        t = None if t is None else t * learning_rate
        out = _predict(
            kernel, x_train, y, x_test, ridge=diag_reg, t=t, get=g, compute_cov=compute_cov
        )
        return Gaussian(*out) if compute_cov else out

    def train_kernel(g: str) -> jax.Array:
        k = jnp.asarray(kernel_fn(x_train, None, g))
        return k.astype(accumulation_dtype(jnp.result_type(k.dtype, y.dtype)))

    @functools.partial(jax.jit, static_argnames=("g", "compute_cov"))
    def on_train(t: Any, g: str, compute_cov: bool) -> Any:
        # x_test=None: neural-tangents' predictions on the training inputs, from the
        # (n, n) training kernel's eigendecomposition (it is held anyway).
        k_dd = train_kernel(g)
        if t is None:
            mean = y.astype(k_dd.dtype)
            return Gaussian(mean, jnp.zeros_like(k_dd)) if compute_cov else mean
        propagate = Propagator(k_dd, diag_reg, 1.0, y.shape[1])
        evals, evecs = jnp.maximum(propagate.evals, 0.0), propagate.evecs
        times = jnp.asarray(t, k_dd.dtype) * learning_rate
        size = y.size

        def at(s: Any) -> Any:
            decay = jnp.exp(-evals * s / size)
            mean = evecs @ ((1 - decay)[:, None] * (evecs.T @ y.astype(k_dd.dtype)))
            if not compute_cov:
                return mean
            if g == "nngp":
                cov = (evecs * (evals * decay**2)) @ evecs.T
            else:
                flow = (evecs * decay) @ evecs.T
                cov = flow @ train_kernel("nngp") @ flow
            return Gaussian(mean, cov)

        if times.ndim == 0:
            return at(times)
        values = jax.vmap(at)(times.reshape(-1))
        return jax.tree.map(lambda a: a.reshape(times.shape + a.shape[1:]), values)

    def predict_fn(
        t: Any = None,
        x_test: Any = None,
        get: Any = None,
        compute_cov: bool = False,
        **kernel_fn_test_test_kwargs: Any,
    ) -> Any:
        if kernel_fn_test_test_kwargs:
            raise NotImplementedError(
                f"kernel_fn keyword arguments {sorted(kernel_fn_test_test_kwargs)} are not "
                "supported by memwise.nt.predict"
            )
        gets, single = _gets(get)
        check_time(t)
        t = None if t is None else jnp.asarray(t)
        out = {}
        for g in gets:
            if x_test is None:
                out[g] = on_train(t, g, compute_cov)
                continue
            out[g] = one(t, x_test, g, compute_cov)
        return _named(out, gets, single)

    return predict_fn


def gradient_descent(*args: Any, **kwargs: Any) -> Any:
    """neural-tangents' ODE-based ``predict.gradient_descent`` (any loss): not supported."""
    raise NotImplementedError(
        "nt.predict.gradient_descent (training dynamics of an arbitrary loss by an ODE "
        "solver) is not supported by memwise.nt; for the MSE use gradient_descent_mse"
    )


def max_learning_rate(
    ntk_train_train: jax.Array,
    y_train_size: int | None = None,
    momentum: float = 0.0,
    eps: float = 1e-12,
) -> float:
    """The largest stable learning rate of gradient descent on MSE, as
    ``nt.predict.max_learning_rate``: ``2 (1 + momentum) N / (lambda_max + eps)``.

    ``N`` is ``y_train_size`` (default: the number of training inputs), ``lambda_max``
    the largest eigenvalue of the 2-D training NTK.

    Example::

        >>> import jax.numpy as jnp
        >>> import memwise.nt as nt
        >>> nt.predict.max_learning_rate(jnp.eye(4) * 2.0)
        4.0
    """
    k = _check_matrix(ntk_train_train, "ntk_train_train")
    factor = k.shape[0] if y_train_size is None else y_train_size
    largest = float(np.linalg.eigvalsh(np.asarray(k, np.float64))[-1])
    return float(2 * (1 + momentum) * factor / (largest + eps))


def __getattr__(name: str) -> Any:
    if name == "ODEState":
        raise NotImplementedError(
            "nt.predict.ODEState (the state of the ODE-based gradient_descent) is not supported "
            "by memwise.nt; gradient_descent_mse takes fx_train_0 and fx_test_0 directly"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
