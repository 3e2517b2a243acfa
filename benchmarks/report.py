"""Benchmark ``report.timeline()``: live memory of the LSTM gradient, nn.scan vs memwise.

The Flax LSTM of the discussion "How to use nn.remat for LSTM to save memory?" (batch 10,
hidden 128, seq2seq=False), its gradient compiled with its loop written as ``nn.scan``
(``lax.scan``: every step's residuals kept) and as ``memwise.flax.scan(checkpoints=16)``.
For each, ``mw.memory_report(...).timeline()`` gives the bytes live at every step of the
compiled schedule (nothing runs); the figure ``results/report_timeline.png`` draws both
curves over the schedule (a while loop's body is one iteration, shaded), the peak marked.
The table lists XLA's compiled totals, the timeline's peak and the largest buffer alive
at it. Memory only: no timing.
"""

from __future__ import annotations

import harness

import memwise as mw
from memwise.measure import format_bytes

FIGURE = "report_timeline.png"


def _timelines(quick: bool):
    import jax

    from memwise.scenarios import lstm

    size = dict(
        batch=10,
        seq_length=1000 if quick else 10_000,
        hidden=128,
        input_dim=32,
        output_dim=4,
        seq2seq=False,
    )
    x, y = lstm.data(
        size["batch"], size["seq_length"], size["input_dim"], size["output_dim"], size["seq2seq"]
    )
    out = []
    for kind, label in (
        ("scan", "nn.scan (lax.scan)"),
        ("memwise", "memwise.flax.scan, checkpoints=16"),
    ):
        net = lstm.model(
            kind,
            hidden=size["hidden"],
            output_dim=size["output_dim"],
            seq2seq=False,
            checkpoints=16 if kind == "memwise" else None,
        )
        params = net.init(jax.random.PRNGKey(0), x[:, :2])["params"]
        report = mw.memory_report(lstm.loss_fn(net), params, x, y, grad=True)
        out.append((label, report, report.timeline()))
    return size, out


def _figure(size: dict, timelines, path) -> None:
    import numpy as np

    from memwise.measure import _pyplot

    plt = _pyplot()
    fig, axes = plt.subplots(len(timelines), 1, figsize=(10, 3.2 * len(timelines)))
    top = max(tl.peak_bytes for _, _, tl in timelines) / 2**20 * 1.1
    for ax, (label, _, tl) in zip(axes, timelines):
        mib = np.asarray(tl.live_bytes, dtype=float) / 2**20
        ax.step(np.arange(len(mib)), mib, where="mid", color="tab:blue")
        ax.fill_between(np.arange(len(mib)), mib, step="mid", alpha=0.15, color="tab:blue")
        for loop in tl.loops:
            ax.axvspan(loop.first - 0.5, loop.last + 0.5, color="tab:orange", alpha=0.12)
        peak = tl.peak_step
        largest = tl.at_peak()[0]
        ax.plot([peak], [mib[peak]], "o", color="tab:red")
        ax.annotate(
            f"peak {format_bytes(tl.peak_bytes)}; largest alive: "
            f"{largest.dtype}{list(largest.shape)} ({largest.op})",
            (peak, mib[peak]),
            textcoords="offset points",
            xytext=(-10, 8),
            ha="right" if peak > len(mib) / 2 else "left",
            color="tab:red",
            fontsize=8,
        )
        ax.set_ylim(0, top)
        ax.set_ylabel("live MiB")
        ax.set_title(
            f"{label}: gradient, T={size['seq_length']:,} (loop bodies shaded, one iteration each)",
            fontsize=10,
        )
    axes[-1].set_xlabel("step of the compiled schedule")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(quick: bool = False) -> None:
    size, timelines = _timelines(quick)
    rows = []
    for label, report, tl in timelines:
        largest = tl.at_peak()[0]
        rows.append(
            {
                "variant": label,
                "temp_bytes": report.temp_bytes,
                "peak_bytes": report.peak_bytes,
                "argument_bytes": report.argument_bytes,
                "output_bytes": report.output_bytes,
                "compile_s": 0.0,
                "time_s": None,
                "time_ratio": None,
                "timeline peak": format_bytes(tl.peak_bytes),
                "schedule steps": len(tl.steps),
                "largest buffer at the peak": f"{format_bytes(largest.nbytes)} "
                f"{largest.dtype}{list(largest.shape)} ({largest.op})",
            }
        )
    table = {
        "title": f"LSTM gradient, T={size['seq_length']:,}, batch {size['batch']}, "
        f"hidden {size['hidden']}: memory timeline",
        "baseline": rows[0]["variant"],
        "repeats": 0,
        "rows": rows,
    }
    harness.print_table(table)
    harness.RESULTS.mkdir(parents=True, exist_ok=True)
    _figure(size, timelines, harness.RESULTS / FIGURE)
    notes = (
        __doc__.split("\n\n")[1].replace("\n", " ")
        + f"\n\n![memory timeline](benchmarks/results/{FIGURE})"
    )
    harness.save("report", [table], notes=notes, quick=quick)


if __name__ == "__main__":
    harness.cli(main)
