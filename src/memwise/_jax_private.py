"""Every use of JAX internals in memwise, in one place, each with why it is needed.

JAX's private modules (``jax._src``) and undocumented attributes change between
releases. memwise keeps each use here, behind a small function, so a new JAX release
breaks one file with a clear message instead of a traceback deep inside a primitive.
The guard below checks, at import, that what these functions reach for still exists.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.extend.core import Primitive as _Primitive
from jax.interpreters import ad as _ad_rules
from jax.interpreters import batching as _batching
from jax.interpreters import mlir as _mlir

# The oldest release the test suite passes on (pyproject.toml declares the same floor and
# `make floor` runs the fast lane on exactly it). 0.8.2 is the first with lax.pcast (the
# rings); 0.10.0 the first whose XLA dumps the live ranges report.timeline() reads; on
# 0.10.0 and 0.10.1 XLA fuses a matmul-heavy tile body less (3x the bytes accessed), so
# the roofline prefers other tiles than the suite expects.
MIN_JAX = (0, 10, 2)

try:
    from jax._src import ad_checkpoint as _ad_checkpoint
    from jax._src import api_util as _api_util
    from jax._src import source_info_util as _source_info_util

    # What the functions below use; checked here so a rename fails at import.
    _source_info_util.register_exclusion, _source_info_util._exclude_paths  # noqa: B018
    _ad_checkpoint._saved_residuals, _api_util.debug_info  # noqa: B018
except (ImportError, AttributeError) as error:  # pragma: no cover - depends on JAX release
    raise ImportError(
        f"memwise needs JAX internals that jax {jax.__version__} does not have ({error}); "
        f"install a jax release >= {'.'.join(map(str, MIN_JAX))} that memwise supports "
        "(see pyproject.toml), or upgrade memwise"
    ) from error

if tuple(jax.__version_info__[:3]) < MIN_JAX:  # pragma: no cover - depends on JAX release
    raise ImportError(
        f"memwise needs jax >= {'.'.join(map(str, MIN_JAX))}, found {jax.__version__}"
    )

__all__ = [
    "exclude_from_source_info",
    "saved_residuals_of_jaxpr",
    "debug_info",
    "varying_axes",
    "forbid_forward_mode",
    "forbid_reverse_mode",
    "hoist_constant_casts",
    "persistent_cache_bypassed",
    "splash_attention_parts",
]


def exclude_from_source_info(directory: str) -> None:
    """Count files under ``directory`` as library code in JAX's source information.

    Why: JAX records the innermost non-library frame of each traced operation (in HLO
    metadata and in saved-residual descriptions). Registering memwise's directory makes
    operations traced inside memwise point at the user's line that called it. This does
    not change JAX's traceback filtering, which keeps a separate list.

    The registered prefix ends with a path separator, so a sibling folder whose name
    starts the same way (``memwise_experiments/``) is not excluded.
    """
    import os

    prefix = os.path.join(os.path.abspath(directory), "")
    if prefix not in _source_info_util._exclude_paths:
        _source_info_util.register_exclusion(prefix)


def saved_residuals_of_jaxpr(jaxpr: Any, arg_names: Any) -> list[tuple[Any, str]]:
    """``(aval, description)`` of each residual output of ``jaxpr``.

    Why: the analysis behind ``jax.ad_checkpoint.print_saved_residuals``; JAX exposes
    only the printing variant, memwise needs the data to group it by source line.
    """
    return _ad_checkpoint._saved_residuals(jaxpr, arg_names)


def debug_info(name: str, fn: Any, args: Any, kwargs: Any) -> Any:
    """JAX's debug info (argument names, result paths) for tracing ``fn``.

    Why: gives the saved-residual analysis the user's argument names ("argument 'x'").
    """
    return _api_util.debug_info(name, fn, args, kwargs)


def varying_axes(leaf: Any) -> frozenset:
    """Mesh axes over which ``leaf`` varies inside ``shard_map`` (empty elsewhere).

    Why: loop carries inside ``shard_map`` must be typed as varying like the loop's
    inputs. The abstract value says so, as ``.mat.varying`` from jax 0.9 on and ``.vma``
    before; neither is documented API.
    """
    aval = jax.typeof(leaf)
    mat = getattr(aval, "mat", None)
    axes = getattr(mat, "varying", None) if mat is not None else getattr(aval, "vma", None)
    return frozenset(axes or ())


# --------------------------------------------------------------------------------------
# The one guard against forward-mode and second-order differentiation of a custom_vjp,
# naming the fix (used by memwise.scan, memwise.while_loop and memwise.ot).
#
# Why: ``jvp`` of a ``custom_vjp`` stages JAX's ``custom_lin``, whose error cannot name
# what to use instead and, under ``jit``, fires only when compiled, so a Python check on
# the inputs never sees it; ``grad`` stages the same ``custom_lin`` and transposes it,
# and there is no public hook that tells the two apart. ``forbid_forward_mode`` is an
# identity whose tangent passes through a guard that raises when it is evaluated,
# compiled or batched (forward mode) and vanishes when it is transposed (reverse mode).
# By default only the innermost differentiation is guarded (so ``jax.hessian``,
# forward-over-reverse, still works for the loops); ``outer=True`` guards every
# differentiation that reaches the value, for rules whose own derivative would be wrong
# (OT's envelope and implicit rules). ``forbid_reverse_mode`` is an identity whose
# tangent raises when it is transposed (reverse mode of a backward pass: grad of grad).
# None of them emits any HLO. They use JAX's documented primitive-extension API
# (jax.extend, jax.interpreters), not jax._src.


def _raise_type_error(*_args: Any, message: str) -> Any:
    raise TypeError(message)


def _identity_primitive(name: str) -> Any:
    p = _Primitive(name)
    p.def_impl(lambda x, **_: x)
    p.def_abstract_eval(lambda x, **_: x)
    _mlir.register_lowering(p, lambda ctx, x, **_: [x])
    _batching.defvectorized(p)
    return p


_tangent_guard_p = _Primitive("memwise_forward_mode_tangent")
_tangent_guard_p.def_impl(_raise_type_error)
_tangent_guard_p.def_abstract_eval(lambda x, **_: x)
_mlir.register_lowering(_tangent_guard_p, _raise_type_error)
_batching.primitive_batchers[_tangent_guard_p] = _raise_type_error
_ad_rules.deflinear2(_tangent_guard_p, lambda ct, x, **_: [ct])

_forward_guard_p = _identity_primitive("memwise_forbid_forward_mode")


def _forward_guard_jvp(primals, tangents, *, message, outer):
    (x,), (dx,) = primals, tangents
    # Without ``outer`` the primal is returned as is: an outer differentiation (the jvp
    # of jax.hessian) pushes its tangent through the loop's forward pass, which is fine.
    # With it, the primal is guarded again, so that outer tangent meets the guard too.
    if outer:
        x = _forward_guard_p.bind(x, message=message, outer=outer)
    if type(dx) is _ad_rules.Zero:
        return x, dx
    return x, _tangent_guard_p.bind(dx, message=message)


_ad_rules.primitive_jvps[_forward_guard_p] = _forward_guard_jvp

_reverse_guard_p = _identity_primitive("memwise_forbid_reverse_mode")
_ad_rules.deflinear2(_reverse_guard_p, _raise_type_error)


def forbid_forward_mode(value: Any, message: str, *, outer: bool = False) -> Any:
    """``value``; forward mode through it raises ``TypeError(message)``.

    ``outer=True`` also raises when the reverse-mode differentiation through it is itself
    differentiated in forward mode (``jax.hessian``, ``jax.jvp`` of ``jax.grad``).
    """
    return _forward_guard_p.bind(value, message=message, outer=outer)


def forbid_reverse_mode(value: Any, message: str) -> Any:
    """``value``; reverse mode through it (transposing its tangent) raises ``TypeError``."""
    return _reverse_guard_p.bind(value, message=message)


def is_unsupported_forward_mode(error: NotImplementedError) -> bool:
    """True for the error JAX's next ``custom_vjp`` raises for forward mode through it.

    Why: with ``jax_custom_vjp3`` (JAX's reimplementation of ``custom_vjp``, off by
    default in 0.10), ``jax.jvp`` of a rule with symbolic zeros raises a bare
    ``NotImplementedError`` and ``jax.linearize`` one saying that a ``lin`` method is
    missing, where the default implementation raises a ``TypeError``; only the text tells
    them from other missing features.
    """
    return not error.args or str(error.args[0]).startswith("for linearize support")


def hoist_constant_casts(closed: Any) -> tuple[Any, list]:
    """``(jaxpr, consts)``: ``closed`` with its constants as leading inputs, and each
    top-level ``pvary`` cast of a constant applied once, here, instead of inside.

    Why: inside ``shard_map`` a function traced with a replicated closed-over array casts
    it to varying where it meets varying values; in a loop body that cast runs every
    step, and its transpose all-reduces the array's cotangent every step. Cast once,
    outside the loop, the loop accumulates local partial cotangents and the cast's
    transpose all-reduces them once. ``pvary`` is an internal primitive name, and JAX
    has no public way to rewrite a jaxpr. Casts inside nested jaxprs stay where they are.
    """
    from jax.extend.core import Var

    jaxpr = closed.jaxpr
    values = dict(zip(jaxpr.constvars, closed.consts))
    eqns = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pvary" and all(
            isinstance(v, Var) and v in values for v in eqn.invars
        ):
            outs = eqn.primitive.bind(*(values[v] for v in eqn.invars), **eqn.params)
            values.update(zip(eqn.outvars, outs if eqn.primitive.multiple_results else [outs]))
        else:
            eqns.append(eqn)
    used = {v for e in eqns for v in e.invars if isinstance(v, Var)}
    used |= {v for v in jaxpr.outvars if isinstance(v, Var)}
    constvars = [v for v in values if v in used]
    hoisted = jaxpr.replace(constvars=[], invars=constvars + list(jaxpr.invars), eqns=eqns)
    return hoisted, [values[v] for v in constvars]


def persistent_cache_bypassed():
    """A context in which compilations skip JAX's persistent compilation cache.

    Why: ``memwise.timeline`` compiles with ``xla_dump_to`` to read XLA's buffer
    analysis, and JAX leaves dump options out of the persistent cache's key: a cache hit
    would return the executable without running the compiler, so nothing is dumped. The
    cache's on/off switch is read once per process, so the check itself is bypassed.
    """
    import contextlib

    from jax._src import compilation_cache

    @contextlib.contextmanager
    def bypassed():
        original = getattr(compilation_cache, "is_cache_used", None)
        if original is None:  # pragma: no cover - a JAX release without the check
            yield
            return
        compilation_cache.is_cache_used = lambda backend: False
        try:
            yield
        finally:
            compilation_cache.is_cache_used = original

    return bypassed()


def splash_attention_parts() -> tuple[Any, Any, Any]:
    """Splash attention's forward, dK/dV and dQ kernels, called one by one:
    ``(forward, backward_dkv, backward_dq)``.

    Why: the public ``make_splash_mha`` kernel returns the log-sum-exp only without a
    derivative (``save_residuals=True`` raises under ``grad``), and memwise's attention
    returns it differentiably (attention sinks, ``return_residual``). Its backward is the
    kernel's own with the log-sum-exp's cotangent folded into the per-row term
    ``D_i = sum(o_i * do_i)`` (``D_i - dlse_i``), which needs the three pieces the public
    ``custom_vjp`` composes. Imported on first use (Pallas's TPU modules are not needed
    on other platforms).
    """
    try:
        from jax.experimental.pallas.ops.tpu.splash_attention import (
            splash_attention_kernel as splash,
        )

        return (
            splash._splash_attention_forward,
            splash._splash_attention_bwd_dkv,
            splash._splash_attention_bwd_dq,
        )
    except (ImportError, AttributeError) as error:  # pragma: no cover - JAX release
        raise ImportError(
            f"memwise's TPU attention needs splash attention's kernels, which jax "
            f"{jax.__version__} does not have as memwise expects ({error}); pass "
            "implementation='xla', or install a jax release memwise supports"
        ) from error
