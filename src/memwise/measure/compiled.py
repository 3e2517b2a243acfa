"""The one measuring function: compile a program and read XLA's ``memory_analysis()``.

XLA assigns every buffer of a compiled program ahead of time, so
``jax.jit(f).lower(*args).compile().memory_analysis()`` states exactly how many bytes of
arguments, outputs and temporaries the program will hold, without executing it. This
module is the one place memwise reads those numbers (:func:`compiled_memory`, and
:func:`compile_measured` when the executable is also to be run): tests, benchmarks,
``fit`` and :func:`memwise.memory_report` all measure through it. The program is
prepared as ``jax.jit`` sees it (static arguments, ``grad``, input checks) by
``memwise._arguments``.

Peak memory is argument + output - alias + temp, or XLA's ``peak_memory_in_bytes`` where
jaxlib reports a larger value (it also counts constants baked into the program). The max
is taken because jaxlib 0.10.2 on CPU reports a ``peak_memory_in_bytes`` that leaves out
temporaries (1 MiB reported for a program with 256 MiB of temporaries): on its own it
would understate the peak. Every figure is the device's: a program that keeps buffers in
host memory (``mw.scan(..., offload="host")``) reports them as ``host_bytes``, and
jaxlib 0.10.2 on a TPU counts them in ``peak_memory_in_bytes`` too (63.2 MB reported for a
program holding 52.4 MB of carries in host memory and about 11 MB on the device, the
same program on the device alone 63.3 MB), so they are taken out of it where it holds
them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from memwise import _arguments

__all__ = ["CompiledMemory", "compile_measured", "compiled_memory"]


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """Buffer sizes of one compiled program, in bytes, exactly as XLA reports them.

    ``host_bytes`` is what the program holds in the host's memory (arguments, outputs and
    temporaries placed there, e.g. offloaded checkpoints; 0 on a CPU), outside the
    device's figures. ``code_bytes`` is XLA's generated code size (0 on backends that do
    not report it);
    ``program_bytes`` is the size of the lowered StableHLO text, which grows with arrays
    baked into the program as constants; ``constant_bytes`` is the total size of those
    constants (closed-over arrays that ``jit`` could not pass as arguments).

    Example::

        >>> import jax.numpy as jnp, memwise as mw
        >>> mem = mw.measure.compiled_memory(lambda x: x * 2, jnp.ones(1000))
        >>> mem.argument_bytes, mem.output_bytes, mem.constant_bytes
        (4000, 4000, 0)
    """

    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    peak_bytes: int
    code_bytes: int
    program_bytes: int
    constant_bytes: int
    host_bytes: int = 0

    @classmethod
    def from_compiled(
        cls, compiled: Any, *, program_bytes: int = 0, constant_bytes: int = 0
    ) -> CompiledMemory:
        """Reads the stats of a ``jax.stages.Compiled``."""
        stats = compiled.memory_analysis()
        if stats is None:
            raise RuntimeError(
                "this backend does not report memory_analysis(); memwise needs it to "
                "measure compiled memory"
            )
        return cls.from_stats(stats, program_bytes=program_bytes, constant_bytes=constant_bytes)

    @classmethod
    def from_stats(
        cls, stats: Any, *, program_bytes: int = 0, constant_bytes: int = 0
    ) -> CompiledMemory:
        """Reads ``memory_analysis()``'s fields from ``stats`` (any object with its
        attribute names: e.g. what a program on another JAX release reported)."""
        argument = int(stats.argument_size_in_bytes)
        output = int(stats.output_size_in_bytes)
        alias = int(stats.alias_size_in_bytes)
        temp = int(stats.temp_size_in_bytes)
        host = sum(
            int(getattr(stats, f"host_{field}_size_in_bytes", 0) or 0)
            for field in ("argument", "output", "temp")
        ) - int(getattr(stats, "host_alias_size_in_bytes", 0) or 0)
        host = max(host, 0)  # an alias is part of the arguments and outputs
        device = argument + output - alias + temp
        reported_peak = int(getattr(stats, "peak_memory_in_bytes", 0) or 0)
        if host and reported_peak >= device + host:
            reported_peak -= host  # the host's bytes counted in the device's peak
        peak = max(reported_peak, device)
        return cls(
            argument_bytes=argument,
            output_bytes=output,
            alias_bytes=alias,
            temp_bytes=temp,
            peak_bytes=peak,
            code_bytes=int(getattr(stats, "generated_code_size_in_bytes", 0) or 0),
            program_bytes=program_bytes,
            constant_bytes=constant_bytes,
            host_bytes=host,
        )


def _check_differentiable(
    fn: Callable, args: Sequence[Any], kwargs: dict, argnums: Sequence[int]
) -> None:
    out = jax.eval_shape(fn, *args, **kwargs)
    if not jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(out)) or out.shape != ():
        shapes = [tuple(leaf.shape) for leaf in jax.tree_util.tree_leaves(out)]
        raise TypeError(
            "grad=True needs fn to return one scalar array; it returned "
            f"{jax.tree_util.tree_structure(out)} with shapes {shapes}. Reduce the output "
            "(e.g. jnp.sum), return the loss alone, or measure fn itself with grad=False"
        )
    if not jnp.issubdtype(out.dtype, jnp.floating):
        raise TypeError(
            f"grad=True needs a real float output, fn returned {out.dtype}; "
            "cast the loss to a float dtype (for a complex loss, take its real part)"
        )
    for i in argnums:
        for leaf in jax.tree_util.tree_leaves(args[i]):
            dtype = jnp.result_type(leaf)
            if not jnp.issubdtype(dtype, jnp.inexact):
                raise TypeError(
                    f"{_arguments.describe(fn, i)} has a leaf of dtype {dtype}, which cannot be "
                    "differentiated; choose float arguments with argnums"
                )


def _target(fn: Callable, grad: bool, argnums: tuple[int, ...]) -> Callable:
    if not grad:
        return fn
    return jax.grad(fn, argnums=argnums[0] if len(argnums) == 1 else argnums)


def compile_measured(
    fn: Callable,
    *args: Any,
    grad: bool = False,
    argnums: int | Sequence[int] = 0,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    **kwargs: Any,
) -> tuple[Any, CompiledMemory]:
    """Compiles ``fn`` (or ``jax.grad(fn, argnums)``) for ``args``: (executable, memory).

    The executable is a ``jax.stages.Compiled``; call it with the traced arguments
    (``None`` in place of static positional ones, static keywords left out). Use it when
    the program is also to be run, so it is compiled once. ``static_argnums`` and
    ``static_argnames`` are those of ``jax.jit``.

    Example::

        >>> import jax.numpy as jnp, memwise as mw
        >>> loss = lambda x: jnp.sum(jnp.sin(x) ** 2)
        >>> compiled, mem = mw.measure.compile_measured(
        ...     loss, jnp.ones(1000), grad=True)
        >>> # the gradient, 1000 floats
        >>> compiled(jnp.zeros(1000)).shape, mem.output_bytes
        ((1000,), 4000)
    """
    lowered, consts = lower(fn, args, kwargs, grad, argnums, static_argnums, static_argnames)
    return compile_lowered(lowered, consts)


def compile_lowered(lowered: Any, consts: list) -> tuple[Any, CompiledMemory]:
    """(executable, its memory) of a program from :func:`lower`; shared with the report."""
    compiled = lowered.compile()
    constant_bytes = sum(int(np.asarray(c).nbytes) for c in consts)
    return compiled, CompiledMemory.from_compiled(
        compiled, program_bytes=len(lowered.as_text()), constant_bytes=constant_bytes
    )


def lower(fn, args, kwargs, grad, argnums, static_argnums, static_argnames):
    """(``jax.stages.Lowered``, the array constants baked into it) of the measured program.

    The arguments are those of :func:`compile_measured`, prepared and checked here once;
    :func:`memwise.memory_report` lowers through it too, so both measure the same program.
    """
    fn, args, kwargs, nums = _arguments.prepare(
        fn,
        args,
        kwargs,
        grad=grad,
        argnums=argnums,
        static_argnums=static_argnums,
        static_argnames=static_argnames,
    )
    with _arguments.static_hint(fn, args, kwargs):
        if grad:
            _check_differentiable(fn, args, kwargs, nums)
        traced = jax.jit(_target(fn, grad, nums)).trace(*args, **kwargs)
    return traced.lower(), [c for c in traced.jaxpr.consts if hasattr(c, "shape")]


def compiled_memory(
    fn: Callable,
    *args: Any,
    grad: bool = False,
    argnums: int | Sequence[int] = 0,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    **kwargs: Any,
) -> CompiledMemory:
    """Compiles ``fn`` (or ``jax.grad(fn, argnums)``) for ``args`` and returns its buffers.

    Nothing runs: arguments may be ``jax.ShapeDtypeStruct``s. This is the one function
    memwise uses to measure memory, in tests, benchmarks and ``fit``. Arguments named by
    ``static_argnums``/``static_argnames`` (Python ints, strings, callables) are passed
    to ``fn`` as they are, as ``jax.jit`` passes static arguments.

    Example::

        >>> import jax.numpy as jnp, memwise as mw
        >>> mem = mw.measure.compiled_memory(lambda x: jnp.sum(jnp.sin(x) ** 2),
        ...                                  jnp.ones(1000), grad=True)
        >>> mem.temp_bytes >= 0
        True
    """
    return compile_measured(
        fn,
        *args,
        grad=grad,
        argnums=argnums,
        static_argnums=static_argnums,
        static_argnames=static_argnames,
        **kwargs,
    )[1]
