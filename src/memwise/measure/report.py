"""The memory report: compiled totals, the backward pass's residuals, and the timeline.

:func:`memory_report` measures a program once through :mod:`memwise.measure.compiled`
and lists what its gradient keeps through :mod:`memwise.measure.saved`;
:class:`MemoryReport` shows them as text, a dict or a bar chart, warns when large arrays
are baked into the program as constants (naming the closed-over objects that hold them,
``memwise._constants``), and keeps the lowered program so that
:meth:`MemoryReport.timeline` can say *when* the memory is live
(:mod:`memwise.timeline`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

from memwise import _constants
from memwise import timeline as _timeline
from memwise._display import _pyplot, check_plot_path, format_bytes
from memwise.measure.compiled import CompiledMemory, compile_lowered, lower
from memwise.measure.saved import Residual, residuals

__all__ = ["MemoryReport", "memory_report"]


_CONSTANT_WARNING_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class MemoryReport(CompiledMemory):
    """Compiled memory of a program and what its backward pass keeps. See memory_report.

    Example::

        >>> import jax.numpy as jnp, memwise as mw
        >>> report = mw.memory_report(lambda x: jnp.sum(jnp.sin(x) ** 2),
        ...                           jnp.ones(1000), grad=True)
        >>> report.grad, report.argument_bytes, report.output_bytes
        (True, 4000, 4000)
        >>> # the backward keeps arrays like x
        >>> report.to_dict()["residuals"][0]["shape"]
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
            >>> tl.peak_bytes <= (report.argument_bytes + report.output_bytes
            ...                   + report.temp_bytes)
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
        >>> report = mw.memory_report(
        ...     loss, jnp.ones((64, 64)), jnp.ones((8, 64)), grad=True)
        >>> # w and x in; the gradient of w out
        >>> report.argument_bytes, report.output_bytes
        (18432, 16384)
        >>> print(report.to_text())
        memory report: gradient of loss  (compiled, not run)
          peak ...
          residuals kept for the backward pass ...
    """
    static: dict[str, Any] = {"static_argnums": static_argnums, "static_argnames": static_argnames}
    lowered, consts = lower(fn, args, kwargs, grad, argnums, static_argnums, static_argnames)
    memory = compile_lowered(lowered, consts)[1]
    return MemoryReport(
        name=getattr(fn, "__name__", type(fn).__name__),
        grad=grad,
        residuals=residuals(fn, *args, argnums=argnums, **static, **kwargs) if grad else (),
        _lowered=lowered,
        _constant_holders=_constants.holders(fn, consts),
        **dataclasses.asdict(memory),
    )
