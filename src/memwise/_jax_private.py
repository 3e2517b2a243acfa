"""Every use of JAX internals in memwise, in one place, each with why it is needed.

JAX's private modules (``jax._src``) and undocumented attributes change between
releases. memwise keeps each use here, behind a small function, so a new JAX release
breaks one file with a clear message instead of a traceback deep inside a primitive.
The guard below checks, at import, that what these functions reach for still exists.
"""

from __future__ import annotations

from typing import Any

import jax

# Releases these uses were written and tested against (pyproject pins the same floor).
MIN_JAX = (0, 7)

try:
    from jax._src import ad_checkpoint as _ad_checkpoint
    from jax._src import api_util as _api_util
    from jax._src import source_info_util as _source_info_util
    from jax._src.interpreters import ad as _ad

    # What the functions below use; checked here so a rename fails at import.
    _ad.JVPTracer, _ad.Zero  # noqa: B018
    _source_info_util.register_exclusion, _source_info_util._exclude_paths  # noqa: B018
    _ad_checkpoint._saved_residuals, _api_util.debug_info  # noqa: B018
except (ImportError, AttributeError) as error:  # pragma: no cover - depends on JAX release
    raise ImportError(
        f"memwise needs JAX internals that jax {jax.__version__} does not have ({error}); "
        f"install a jax release >= {'.'.join(map(str, MIN_JAX))} that memwise supports "
        "(see pyproject.toml), or upgrade memwise"
    ) from error

if tuple(jax.__version_info__[:2]) < MIN_JAX:  # pragma: no cover - depends on JAX release
    raise ImportError(
        f"memwise needs jax >= {'.'.join(map(str, MIN_JAX))}, found {jax.__version__}"
    )

__all__ = [
    "is_forward_mode",
    "exclude_from_source_info",
    "saved_residuals_of_jaxpr",
    "debug_info",
    "varying_axes",
]


def is_forward_mode(leaf: Any) -> bool:
    """True when ``leaf`` is being pushed forward by ``jvp`` with a nonzero tangent.

    Why: a ``custom_vjp`` cannot be forward-differentiated, and JAX's own error does not
    say what to use instead. ``grad`` traces with ``LinearizeTracer``, so a ``JVPTracer``
    with a real tangent means ``jvp``/``jacfwd``; there is no public way to ask.
    """
    return isinstance(leaf, _ad.JVPTracer) and not isinstance(leaf.tangent, _ad.Zero)


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
