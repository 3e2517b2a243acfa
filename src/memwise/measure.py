"""Where a program's memory goes, read from the compiler before anything runs.

XLA assigns every buffer of a compiled program ahead of time, so
``jax.jit(f).lower(*args).compile().memory_analysis()`` states exactly how many bytes of
arguments, outputs and temporaries the program will hold, without executing it. This
module is the one place memwise reads those numbers (:func:`compiled_memory`), and adds
what the compiler cannot say: which arrays the backward pass of ``jax.grad`` keeps
(``residuals``, from ``jax.ad_checkpoint``'s saved-residual analysis) and the line of user
code that produced each of them (:func:`memory_report`). It also reads budgets
(:func:`parse_budget`: bytes, ``"8GiB"``, ``"1e9"``, or a fraction of
:func:`device_memory_bytes`). A report's :meth:`MemoryReport.timeline` says *when* the
memory is live, step by step along the compiled schedule (:mod:`memwise.timeline`).

Peak memory is argument + output - alias + temp, or XLA's ``peak_memory_in_bytes`` where
jaxlib reports a larger value (it also counts constants baked into the program). The max
is taken because jaxlib 0.10.2 on CPU reports a ``peak_memory_in_bytes`` that leaves out
temporaries (1 MiB reported for a program with 256 MiB of temporaries): on its own it
would understate the peak.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from memwise import _arguments, _constants, _jax_private, _residual_labels
from memwise import timeline as _timeline
from memwise._display import _pyplot, check_plot_path, format_bytes  # noqa: F401 - re-exported

__all__ = [
    "CompiledMemory",
    "MemoryReport",
    "Residual",
    "compile_measured",
    "compiled_memory",
    "device_memory_bytes",
    "host_memory_bytes",
    "memory_report",
    "parse_budget",
    "residuals",
]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """Buffer sizes of one compiled program, in bytes, exactly as XLA reports them.

    ``code_bytes`` is XLA's generated code size (0 on backends that do not report it);
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
        argument = int(stats.argument_size_in_bytes)
        output = int(stats.output_size_in_bytes)
        alias = int(stats.alias_size_in_bytes)
        temp = int(stats.temp_size_in_bytes)
        reported_peak = int(getattr(stats, "peak_memory_in_bytes", 0) or 0)
        peak = max(reported_peak, argument + output - alias + temp)
        return cls(
            argument_bytes=argument,
            output_bytes=output,
            alias_bytes=alias,
            temp_bytes=temp,
            peak_bytes=peak,
            code_bytes=int(getattr(stats, "generated_code_size_in_bytes", 0) or 0),
            program_bytes=program_bytes,
            constant_bytes=constant_bytes,
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
        >>> compiled, mem = mw.measure.compile_measured(loss, jnp.ones(1000), grad=True)
        >>> compiled(jnp.zeros(1000)).shape, mem.output_bytes  # the gradient, 1000 floats
        ((1000,), 4000)
    """
    lowered, consts = _lower(fn, args, kwargs, grad, argnums, static_argnums, static_argnames)
    return _compile(lowered, consts)


def _compile(lowered: Any, consts: list) -> tuple[Any, CompiledMemory]:
    compiled = lowered.compile()
    constant_bytes = sum(int(np.asarray(c).nbytes) for c in consts)
    return compiled, CompiledMemory.from_compiled(
        compiled, program_bytes=len(lowered.as_text()), constant_bytes=constant_bytes
    )


def _lower(fn, args, kwargs, grad, argnums, static_argnums, static_argnames):
    """(``jax.stages.Lowered``, the array constants baked into it) of the measured program."""
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


# ----------------------------------------------------------------------------------------
# Saved residuals


@dataclasses.dataclass(frozen=True)
class Residual:
    """Arrays the backward pass keeps that come from one source.

    ``source`` is ``file:line`` of the user code that produced them, or
    ``argument 'name'``; ``count`` arrays were grouped under it, ``shape``/``dtype`` are
    those of the largest, ``nbytes`` their total, ``what`` the producing operations.

    Example::

        >>> import jax.numpy as jnp, memwise as mw
        >>> mw.measure.residuals(lambda x: jnp.sum(jnp.sin(x)), jnp.ones(8))[0]
        Residual(shape=(8,), dtype='float32', nbytes=32, source='...', count=1, what='cos')
    """

    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    source: str
    count: int = 1
    what: str = ""


_OUTPUT_RE = re.compile(r"^(?:output of|named) (?P<what>.+?) from (?P<where>.+)$")
_WHERE_RE = re.compile(r"^(?P<file>.+?):(?P<line>\d+)(?::\d+)?(?: \((?P<func>.*)\))?$")


def _parse_source(description: str) -> tuple[str, str]:
    """('file:line' or "argument 'x'", what) from a JAX saved-residual description."""
    if description.startswith("from the argument"):
        # leaves of one argument (params['w'], params[3], ...) are grouped under it
        name = description.removeprefix("from the argument").strip()
        return _timeline.argument_source(name), "argument"
    match = _OUTPUT_RE.match(description)
    if match is None:
        return description, ""
    where = _WHERE_RE.match(match["where"])
    location = f"{where['file']}:{where['line']}" if where else match["where"]
    # memwise's guard primitives (identities on mw.scan / mw.while_loop checkpoints) are
    # named for what they hold, not by their internal name
    what = match["what"]
    return location, "checkpoint" if what.startswith("memwise_") else what


# JAX records the innermost *user* frame of each operation it traces. Counting memwise's
# own files as library code, like JAX's, makes residuals (and HLO metadata) created inside
# mw.scan / mw.chunked_map point at the user's line that called them. JAX's traceback
# filtering keeps a separate list and is not changed. Registered once, at import, because
# JAX caches traces: a registration only around the report would miss earlier traces.
_jax_private.exclude_from_source_info(_PACKAGE_DIR)


def saved_residuals(
    fn: Callable, *args: Any, argnums: Sequence[int] = (0,), **kwargs: Any
) -> list[tuple[Any, str]]:
    """What ``jax.grad(fn, argnums)`` keeps for its backward pass: (aval, description).

    The same analysis as ``jax.ad_checkpoint.print_saved_residuals`` (only the printing
    variant is public in JAX 0.10), restricted to the arguments in ``argnums``: the others
    stay inputs of the traced program, so they are listed when the backward needs them and
    nothing is listed that only their (unrequested) gradient would need.
    """
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs))

    def vjp_of_selected(*flat):
        all_args, all_kwargs = jax.tree_util.tree_unflatten(tree, flat)

        def selected(*diff):
            full = list(all_args)
            for i, value in zip(argnums, diff):
                full[i] = value
            return fn(*full, **all_kwargs)

        return jax.vjp(selected, *(all_args[i] for i in argnums))

    closed, out_shape = jax.make_jaxpr(vjp_of_selected, return_shape=True)(*leaves)
    n_residuals = len(jax.tree_util.tree_leaves(out_shape[1]))
    debug = _jax_private.debug_info("memory_report", fn, args, kwargs)
    jaxpr = closed.jaxpr.replace(
        outvars=closed.jaxpr.outvars[len(closed.jaxpr.outvars) - n_residuals :],
        debug_info=debug._replace(result_paths=None),
    )
    names = debug.arg_names or ("",) * len(jaxpr.invars)
    saved = _jax_private.saved_residuals_of_jaxpr(jaxpr, names)
    # "tanh derivative", not the "sub" that tanh's differentiation rule computes
    return _residual_labels.name_derivatives(
        closed.jaxpr, len(closed.jaxpr.outvars) - n_residuals, saved
    )


def _group_residuals(raw: Sequence[tuple[Any, str]]) -> list[Residual]:
    groups: dict[str, list[tuple[Any, str]]] = {}
    for aval, description in raw:
        source, what = _parse_source(description)
        groups.setdefault(source, []).append((aval, what))
    residuals = []
    for source, members in groups.items():
        sizes = [
            int(np.prod(a.shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize for a, _ in members
        ]
        largest = members[int(np.argmax(sizes))][0]
        whats = sorted({w for _, w in members if w})
        residuals.append(
            Residual(
                shape=tuple(int(d) for d in largest.shape),
                dtype=str(np.dtype(largest.dtype)),
                nbytes=int(sum(sizes)),
                source=source,
                count=len(members),
                what=", ".join(whats),
            )
        )
    residuals.sort(key=lambda r: (-r.nbytes, r.source))
    return residuals


def residuals(
    fn: Callable,
    *args: Any,
    argnums: int | Sequence[int] = 0,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    **kwargs: Any,
) -> tuple[Residual, ...]:
    """What ``jax.grad(fn, argnums)`` keeps for its backward pass, by source, largest first.

    Traces, never compiles: the ``residuals`` of :func:`memory_report` without the
    compiled totals, so it is cheap enough to ask about a program too large to compile.

    Example::

        >>> import jax.numpy as jnp, memwise as mw
        >>> kept = mw.measure.residuals(lambda x: jnp.sum(jnp.sin(x)), jnp.ones(8))
        >>> [(r.what, r.shape, r.nbytes) for r in kept]  # sin's backward keeps cos(x)
        [('cos', (8,), 32)]
    """
    fn, args, kwargs, nums = _arguments.prepare(
        fn,
        args,
        kwargs,
        grad=True,
        argnums=argnums,
        static_argnums=static_argnums,
        static_argnames=static_argnames,
    )
    with _arguments.static_hint(fn, args, kwargs):
        return tuple(_group_residuals(saved_residuals(fn, *args, argnums=nums, **kwargs)))


# ----------------------------------------------------------------------------------------
# Budgets

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}

_BUDGET_FORMS = (
    "bytes as an int (1 << 30) or a string ('8GiB', '2.5 GB', '512MB', '1e9', "
    "'1,000,000', '1_000_000'), or a fraction of device memory in (0, 1] such as 0.8"
)

# A number (thousands separated by ',' or '_' allowed, decimals, an exponent), then a unit.
_NUMBER = r"(?:\d{1,3}(?:,\d{3})+|\d+(?:_\d+)*)(?:\.\d*)?|\.\d+"
_BUDGET_RE = re.compile(
    rf"\s*(?P<sign>[+-]?)\s*(?P<number>(?:{_NUMBER})(?:[eE][+-]?\d+)?)"
    r"\s*(?P<unit>[a-zA-Z]*)\s*"
)


def host_memory_bytes() -> int:
    """Physical memory of this machine (8 GiB where the OS does not say).

    Example::

        >>> from memwise.measure import host_memory_bytes
        >>> host_memory_bytes() >= 2**20
        True
    """
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 8 << 30


def device_memory_bytes() -> int:
    """Memory of the default device: the allocator's limit, or the host's RAM on CPU.

    Example::

        >>> from memwise.measure import device_memory_bytes, parse_budget
        >>> parse_budget(0.5) == device_memory_bytes() // 2  # a float budget is a fraction
        True
    """
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - backends without memory_stats
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return host_memory_bytes()


def parse_budget(budget: int | float | str) -> int:
    """Bytes from ``1 << 30``, ``"8GiB"``, ``"2.5 GB"``, ``"1e9"``, ``"1,000"`` or ``0.8``.

    An int or a string is bytes: a string is a number (thousands separated by ``,`` or
    ``_``, decimals and exponents allowed) with an optional decimal (``MB``) or binary
    (``MiB``) unit. A float is a fraction of :func:`device_memory_bytes` in (0, 1].

    Raises:
      ValueError: for zero, negative, NaN or infinite budgets and unreadable strings; the
        message lists the accepted forms.
      TypeError: for other types (a bool, None, a list).

    Example::

        >>> from memwise.measure import parse_budget
        >>> parse_budget("1.5 KiB"), parse_budget("2MB"), parse_budget(4096)
        (1536, 2000000, 4096)
        >>> parse_budget("1e9"), parse_budget("1,000"), parse_budget("2.5GiB")
        (1000000000, 1000, 2684354560)
    """
    # Concrete types rather than numbers.Integral/Real, which type checkers cannot relate
    # to int and float.
    if isinstance(budget, (bool, np.bool_)) or not isinstance(
        budget, (int, np.integer, float, np.floating, str)
    ):
        raise TypeError(f"budget must be {_BUDGET_FORMS}; got {type(budget).__name__} {budget!r}")
    if isinstance(budget, (int, np.integer)):
        if budget <= 0:
            raise ValueError(f"budget must be positive, got {budget}; pass {_BUDGET_FORMS}")
        return int(budget)
    if isinstance(budget, (float, np.floating)):
        if not 0 < budget <= 1:  # also rejects NaN
            raise ValueError(
                f"a float budget is a fraction of device memory in (0, 1], got {budget!r}; "
                f"for bytes pass an int or a string: {_BUDGET_FORMS}"
            )
        return int(budget * device_memory_bytes())
    match = _BUDGET_RE.fullmatch(budget)
    if match is None or match["unit"].lower() not in _UNITS:
        raise ValueError(f"cannot read budget {budget!r}; write {_BUDGET_FORMS}")
    value = float(match["number"].replace(",", "")) * _UNITS[match["unit"].lower()]
    if match["sign"] == "-" or not math.isfinite(value) or int(value) <= 0:
        raise ValueError(
            f"budget must be a finite size of at least one byte, got {budget!r}; write {_BUDGET_FORMS}"
        )
    return int(value)


# ----------------------------------------------------------------------------------------
# The report


_CONSTANT_WARNING_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class MemoryReport(CompiledMemory):
    """Compiled memory of a program and what its backward pass keeps. See memory_report.

    Example::

        >>> import jax.numpy as jnp, memwise as mw
        >>> report = mw.memory_report(lambda x: jnp.sum(jnp.sin(x) ** 2), jnp.ones(1000), grad=True)
        >>> report.grad, report.argument_bytes, report.output_bytes
        (True, 4000, 4000)
        >>> report.to_dict()["residuals"][0]["shape"]  # the backward keeps arrays like x
        (1000,)
    """

    name: str = ""
    grad: bool = False
    residuals: tuple[Residual, ...] = ()
    # The lowered program, kept to compile it again with XLA's dump for timeline().
    _lowered: Any = dataclasses.field(default=None, repr=False, compare=False)
    # The closed-over objects that hold the constants, named in the warning.
    _constant_holders: tuple[_constants.Holder, ...] = dataclasses.field(
        default=(), repr=False, compare=False
    )

    @property
    def residual_bytes(self) -> int:
        return sum(r.nbytes for r in self.residuals)

    def timeline(self) -> _timeline.Timeline:
        """Live bytes at every step of the compiled program, the peak and who is alive there.

        Compiles the program once more with XLA's dump on (into a temporary directory,
        removed afterwards) and reads XLA's live ranges and buffer assignment: nothing
        runs. A while loop (``lax.scan``, ``mw.scan``, the chunked primitives' tile loops)
        appears once, as one iteration of its body, inlined before the loop's own step;
        the buffers it carries are live across the whole loop.

        Returns:
          A :class:`memwise.timeline.Timeline`: ``live_bytes`` per step, ``peak_step``,
          ``peak_bytes``, ``at_peak()`` (buffers alive at the peak with shape, dtype,
          bytes, producing operation and the user's source line), ``loops``,
          ``to_dict()``, ``to_text()`` and ``plot(path)``. Its maximum is at most
          ``argument_bytes + output_bytes - alias_bytes + temp_bytes``; the gap is what
          the allocator's packing leaves unused at the peak.

        Example::

            >>> import jax.numpy as jnp, memwise as mw
            >>> report = mw.memory_report(lambda x: jnp.sum(jnp.sin(x) ** 2),
            ...                           jnp.ones(1000), grad=True)
            >>> tl = report.timeline()
            >>> tl.peak_bytes <= report.argument_bytes + report.output_bytes + report.temp_bytes
            True
        """
        if self._lowered is None:
            raise RuntimeError(
                "this report holds no program to compile (it was built by hand); make it "
                "with mw.memory_report to get its timeline"
            )
        cached = self.__dict__.get("_timeline_cache")
        if cached is None:
            kind = "gradient of " if self.grad else ""
            cached = _timeline.of_lowered(self._lowered, name=f"{kind}{self.name}")
            object.__setattr__(self, "_timeline_cache", cached)
        return cached

    def to_dict(self) -> dict:
        """JSON-ready dict of every field."""
        out = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if not f.name.startswith("_")
        }
        out["residuals"] = [dataclasses.asdict(r) for r in self.residuals]
        out["residual_bytes"] = self.residual_bytes
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_text(self, max_rows: int = 20) -> str:
        """An aligned table: compiled totals, then residuals by source, largest first."""
        kind = "gradient of " if self.grad else ""
        lines = [f"memory report: {kind}{self.name}  (compiled, not run)"]
        totals = [
            ("peak", self.peak_bytes),
            ("arguments", self.argument_bytes),
            ("outputs", self.output_bytes),
            ("aliased", self.alias_bytes),
            ("temporaries", self.temp_bytes),
            ("constants", self.constant_bytes),
        ]
        width = max(len(k) for k, _ in totals)
        for key, value in totals:
            lines.append(f"  {key:<{width}}  {format_bytes(value):>10}  ({value:,} B)")
        # Constants of a size comparable to the arguments are closed-over data (the
        # parameters a closure captured, as in a linearized network whose closure holds
        # them next to a batch as large); small tables such as a scan's schedule are not.
        if self.constant_bytes >= max(_CONSTANT_WARNING_BYTES, self.argument_bytes // 4):
            lines.append("  " + _constants.warning(self.constant_bytes, self._constant_holders))
        if self.grad:
            lines.append("")
            if not self.residuals:
                lines.append("  the backward pass keeps no residuals")
            else:
                rows = [
                    (
                        format_bytes(r.nbytes),
                        str(r.count),
                        f"{r.dtype}{list(r.shape)}",
                        r.what,
                        r.source,
                    )
                    for r in self.residuals[:max_rows]
                ]
                header = ("kept", "n", "largest", "op", "source")
                widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
                a, b, c, d = widths[:4]
                fmt = f"  {{:>{a}}}  {{:>{b}}}  {{:<{c}}}  {{:<{d}}}  {{}}"
                lines.append(
                    f"  residuals kept for the backward pass ({format_bytes(self.residual_bytes)} in all):"
                )
                lines.append(fmt.format(*header))
                lines.extend(fmt.format(*row) for row in rows)
                hidden = len(self.residuals) - max_rows
                if hidden > 0:
                    rest = sum(r.nbytes for r in self.residuals[max_rows:])
                    lines.append(f"  ... {hidden} more sources, {format_bytes(rest)}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_text()

    def plot(self, path: str | os.PathLike, *, max_rows: int = 15) -> None:
        """Horizontal bar chart of the largest residual sources (needs matplotlib).

        Raises:
          ValueError: when matplotlib cannot write ``path``'s file format.
        """
        check_plot_path(path)
        plt = _pyplot()
        rows = list(self.residuals[:max_rows])[::-1]
        fig, ax = plt.subplots(figsize=(9, 1.5 + 0.4 * max(len(rows), 1)))
        labels = [f"{os.path.basename(r.source)} ({r.what})" if r.what else r.source for r in rows]
        ax.barh(labels, [r.nbytes / 2**20 for r in rows], color="tab:blue")
        ax.set_xlabel("MiB kept for the backward pass")
        ax.set_title(
            f"{self.name}: peak {format_bytes(self.peak_bytes)}, "
            f"temporaries {format_bytes(self.temp_bytes)}"
        )
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)


def memory_report(
    fn: Callable,
    *args: Any,
    grad: bool = False,
    argnums: int | Sequence[int] = 0,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    **kwargs: Any,
) -> MemoryReport:
    """Where the memory of ``fn`` (or of its gradient) goes, by compiling, never running.

    Args:
      fn: the function to measure; with ``grad=True`` it must return a float scalar.
      *args: its arguments (arrays or ``jax.ShapeDtypeStruct``s).
      grad: measure ``jax.grad(fn, argnums)`` and list what its backward pass keeps.
      argnums: the arguments to differentiate with ``grad=True`` (never static ones).
      static_argnums: arguments passed to ``fn`` as Python values, as ``jax.jit``
        passes static arguments: an int used in ``range``, a string option, a function.
      static_argnames: the same, by name.
      **kwargs: keyword arguments passed to ``fn``.

    Returns:
      A :class:`MemoryReport`: compiled ``peak_bytes``, ``temp_bytes``,
      ``argument_bytes``, ``output_bytes``, ``alias_bytes`` (equal to XLA's
      ``memory_analysis()``), ``constant_bytes`` and, with ``grad=True``, ``residuals``
      grouped by the source line that produced them, largest first.

    Example::

        >>> import jax, jax.numpy as jnp, memwise as mw
        >>> def loss(w, x):
        ...     return jnp.sum(jnp.tanh(x @ w) ** 2)
        >>> report = mw.memory_report(loss, jnp.ones((64, 64)), jnp.ones((8, 64)), grad=True)
        >>> report.argument_bytes, report.output_bytes  # w and x in; the gradient of w out
        (18432, 16384)
        >>> print(report.to_text())
        memory report: gradient of loss  (compiled, not run)
          peak ...
          residuals kept for the backward pass ...
    """
    static: dict[str, Any] = {"static_argnums": static_argnums, "static_argnames": static_argnames}
    lowered, consts = _lower(fn, args, kwargs, grad, argnums, static_argnums, static_argnames)
    memory = _compile(lowered, consts)[1]
    return MemoryReport(
        name=getattr(fn, "__name__", type(fn).__name__),
        grad=grad,
        residuals=residuals(fn, *args, argnums=argnums, **static, **kwargs) if grad else (),
        _lowered=lowered,
        _constant_holders=_constants.holders(fn, consts),
        **dataclasses.asdict(memory),
    )
