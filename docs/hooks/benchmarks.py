"""MkDocs hook: the Benchmarks page and its plots, from ``benchmarks/results/*.json``.

The page's text is BENCHMARKS.md's, rendered by the same function
(``benchmarks/run.py``'s ``markdown()``, which ``python benchmarks/run.py
--markdown-only`` writes to BENCHMARKS.md); this hook adds a plot to each benchmark's
section where a picture says it faster. Nothing is written to the source tree: the page
and the PNGs are added to the build as generated files (``on_files``), so a plain
``mkdocs build`` produces them.

``python docs/hooks/benchmarks.py OUT_DIR`` writes the same files to ``OUT_DIR``.
"""

from __future__ import annotations

import importlib.util
import io
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
PAGE = "benchmarks.md"
PLOTS = "benchmarks/plots"  # plots' path in the site, next to the page
MIB = 2**20

Table = dict[str, Any]
Figure = Any  # matplotlib.figure.Figure


# --------------------------------------------------------------------------------------
# the text: benchmarks/run.py's rendering


def _run_module() -> Any:
    """``benchmarks/run.py`` as a module (it puts ``benchmarks/`` on the path itself)."""
    spec = importlib.util.spec_from_file_location("_memwise_benchmarks_run", BENCHMARKS / "run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sections(text: str) -> tuple[str, list[tuple[str, str]]]:
    """The page's preamble and its ``## name`` sections, as ``(name, text)``."""
    parts = re.split(r"^## (\S+)\n", text, flags=re.M)
    return parts[0], list(zip(parts[1::2], parts[2::2]))


def _insert_after_first_paragraph(section: str, block: str) -> str:
    """``block`` after the section's first paragraph (its date, machine and versions)."""
    head, sep, rest = section.lstrip("\n").partition("\n\n")
    return f"\n{head}\n\n{block}\n\n{rest}" if sep else f"\n{head}\n\n{block}\n"


# --------------------------------------------------------------------------------------
# the plots


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _table(result: dict, prefix: str) -> Table | None:
    return next((t for t in result["tables"] if t["title"].startswith(prefix)), None)


def _mib(row: dict, key: str = "temp_bytes") -> float:
    return row[key] / MIB


def _log(ax: Any, axis: str = "x") -> None:
    """A log scale labelled with plain numbers (1, 10, 100), no minor labels."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    getattr(ax, f"set_{axis}scale")("log")
    target = ax.xaxis if axis == "x" else ax.yaxis
    target.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.10g}"))
    target.set_minor_formatter(NullFormatter())


def _bars(ax: Any, table: Table, title: str) -> None:
    """Horizontal bars of the gradient's temp memory per variant, log scale."""
    rows = [r for r in table["rows"] if r["temp_bytes"] > 0]
    names = [r["variant"] for r in rows]
    values = [_mib(r) for r in rows]
    colors = ["C0" if "memwise" in n or n.startswith("mw.") else "C7" for n in names]
    y = range(len(rows))
    ax.barh(y, values, color=colors)
    ax.set_yticks(list(y), names, fontsize=8)
    ax.invert_yaxis()
    _log(ax)
    ax.set_xlabel("temp memory (MiB, log scale)")
    ax.set_title(title, fontsize=9)
    for yi, v in zip(y, values):
        ax.text(v, yi, f" {v:,.1f}", va="center", fontsize=7)
    ax.margins(x=0.25)


def _plot_mlp(result: dict, plt: Any) -> list[tuple[Figure, str]]:
    table = result["tables"][0]
    fig, ax = plt.subplots(figsize=(7, 2.6))
    _bars(ax, table, table["title"])
    return [(fig, "Gradient temp memory of each variant (memwise in blue).")]


def _plot_lstm(result: dict, plt: Any) -> list[tuple[Figure, str]]:
    tables = [t for t in result["tables"] if t["title"].startswith("LSTM gradient, T=10,000")]
    if not tables:
        return []
    names: list[str] = []
    for t in tables:
        names += [r["variant"] for r in t["rows"] if r["variant"] not in names]
    fig, ax = plt.subplots(figsize=(7, 3.4))
    height = 0.8 / len(tables)
    for k, t in enumerate(tables):
        by_name = {r["variant"]: _mib(r) for r in t["rows"]}
        label = "seq2seq=True" if "seq2seq=True" in t["title"] else "seq2seq=False"
        ys = [i + k * height for i, n in enumerate(names) if n in by_name]
        ax.barh(ys, [by_name[n] for n in names if n in by_name], height=height, label=label)
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(names))], names, fontsize=8)
    ax.invert_yaxis()
    _log(ax)
    ax.set_xlabel("gradient temp memory (MiB, log scale)")
    ax.set_title("LSTM gradient, T=10,000, batch 10, hidden 128", fontsize=9)
    ax.legend(fontsize=8)
    return [(fig, "Gradient temp memory of the LSTM for each way of writing its loop.")]


def _plot_pairwise(result: dict, plt: Any) -> list[tuple[Figure, str]]:
    tables = result["tables"]
    fig, axes = plt.subplots(len(tables), 1, figsize=(7, 2.4 * len(tables)))
    for ax, table in zip(list(getattr(axes, "flat", [axes])), tables):
        _bars(ax, table, table["title"])
    fig.tight_layout()
    return [(fig, "Compiled temp memory, forward and gradient (memwise in blue).")]


def _plot_pointcloud(result: dict, plt: Any) -> list[tuple[Figure, str]]:
    table = _table(result, "gradient of reg_ot_cost")
    if table is None:
        return []
    fig, ax = plt.subplots(figsize=(7, 2.4))
    _bars(ax, table, table["title"])
    return [(fig, "Gradient temp memory of one Sinkhorn solve (memwise in blue).")]


def _plot_kip(result: dict, plt: Any) -> list[tuple[Figure, str]]:
    table = _table(result, "KIP gradient vs number of targets")
    if table is None:
        return []
    fig, ax = plt.subplots(figsize=(7, 3.4))
    dense = [r for r in table["rows"] if r["variant"].startswith("dense")]
    tiled = [r for r in table["rows"] if r["variant"].startswith("mw.")]
    nt = [r for r in dense if r.get("neural-tangents temp MiB")]
    ax.plot(
        [r["targets"] for r in dense], [_mib(r) for r in dense], "o-", color="C7", label="dense JAX"
    )
    ax.plot(
        [r["targets"] for r in nt],
        [r["neural-tangents temp MiB"] for r in nt],
        "s--",
        color="C3",
        label="neural-tangents 0.6.5",
    )
    ax.plot(
        [r["targets"] for r in tiled],
        [_mib(r) for r in tiled],
        "o-",
        color="C0",
        label="mw.ntk.kip_loss, tiles (500, 10)",
    )
    pooling = _table(result, "KIP gradient with pooling kernels")
    if pooling is not None:
        for kernel, marker in (("myrtle", "^"), ("resnet", "v")):
            rows = [r for r in pooling["rows"] if r["variant"].startswith(kernel)]
            if rows:
                ax.plot(
                    [r["targets"] for r in rows],
                    [_mib(r) for r in rows],
                    marker + "-",
                    label=f"mw.ntk.kip_loss, {kernel} kernel",
                )
    _log(ax)
    _log(ax, "y")
    ax.set_xlabel("targets (log scale)")
    ax.set_ylabel("gradient temp (MiB, log scale)")
    ax.set_title("KIP loss gradient w.r.t. 100 support images (28x28x1), compiled", fontsize=9)
    ax.legend(fontsize=8)
    return [(fig, "Gradient temp memory against the number of targets.")]


def _plot_linearize(result: dict, plt: Any) -> list[tuple[Figure, str]]:
    table = result["tables"][0]
    rows = table["rows"]
    names = [r["variant"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(7, 2.4), sharey=True)
    y = list(range(len(rows)))
    axes[0].barh(y, [r["program bytes"] / 1e6 for r in rows], color="C0", label="program")
    axes[0].barh(
        y, [r["constant bytes"] / 1e6 for r in rows], color="C3", label="of which constants"
    )
    axes[0].set_xlabel("program text (MB)")
    axes[0].legend(fontsize=7)
    axes[1].barh(y, [_mib(r) for r in rows], color="C7")
    axes[1].set_xlabel("temp memory (MiB)")
    axes[0].set_yticks(y, names, fontsize=8)
    axes[0].invert_yaxis()
    fig.suptitle("SGD step of a Flax ViT (4.77M parameters) and of its linearization", fontsize=9)
    fig.tight_layout()
    return [(fig, "Compiled program size (closed-over weights become constants) and temp memory.")]


def _plot_fit(result: dict, plt: Any) -> list[tuple[Figure, str]]:
    tables = result["tables"]
    fig, axes = plt.subplots(1, len(tables), figsize=(7.5, 2.8))
    for ax, table in zip(list(getattr(axes, "flat", [axes])), tables):
        hand = sorted(
            (r for r in table["rows"] if r.get("kind") == "hand-picked" and r["time_ratio"]),
            key=lambda r: r["peak_bytes"],
        )
        ax.plot(
            [_mib(r, "peak_bytes") for r in hand],
            [r["time_ratio"] for r in hand],
            "o-",
            color="C7",
            ms=3,
            label="hand-picked",
        )
        for kind, marker, color in (("fit", "x", "C0"), ("fit, tune=True", "+", "C3")):
            rows = [r for r in table["rows"] if r.get("kind") == kind and r["time_ratio"]]
            ax.plot(
                [_mib(r, "peak_bytes") for r in rows],
                [r["time_ratio"] for r in rows],
                marker,
                color=color,
                ms=8,
                label=f"mw.{kind}" if kind == "fit" else "mw.fit(tune=True)",
            )
        _log(ax)
        ax.set_title(table["title"].split(":")[0], fontsize=9)
        ax.set_xlabel("compiled peak (MiB, log)", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0].set_ylabel("time / largest setting's", fontsize=8)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return [
        (
            fig,
            "Every hand-picked setting (peak, time) and the plans mw.fit chose under each budget.",
        )
    ]


def _plot_sharding(result: dict, plt: Any) -> list[tuple[Figure, str]]:
    # the scaling tables (rows "D = 1" ... "D = 8"), not the ring-or-whole and
    # process-count tables
    tables = [t for t in result["tables"] if t["title"].endswith("per device, ring mode")]
    if not tables:
        return []
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for table in tables:
        rows = table["rows"]
        d = [int(r["variant"].split("=")[1]) for r in rows]
        per = [r["argument_bytes"] + r["temp_bytes"] for r in rows]
        ax.plot(d, [p / per[0] for p in per], "o-", label=table["title"].split(",")[0])
    ds = sorted({int(r["variant"].split("=")[1]) for t in tables for r in t["rows"]})
    ax.plot(ds, [1 / x for x in ds], "k--", lw=1, label="1/D")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    from matplotlib.ticker import FuncFormatter

    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xticks(ds, [str(x) for x in ds])
    ax.set_xlabel("devices D")
    ax.set_ylabel("per-device arguments + temp / D=1's")
    ax.set_title("Per-device memory of value_and_grad on D virtual CPU devices", fontsize=9)
    ax.legend(fontsize=8)
    return [(fig, "Per-device memory against the number of devices, relative to one device.")]


def _plot_while_loop(result: dict, plt: Any) -> list[tuple[Figure, str]]:
    tables = [t for t in result["tables"] if t["title"].startswith("synthetic loop")]
    if not tables:
        return []
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for k, table in enumerate(tables):
        c = re.search(r"c=(\d+)", table["title"])[1]
        for who, style in (("equinox", "s--"), ("memwise", "o-")):
            rows = [r for r in table["rows"] if r["variant"].startswith(who)]
            ts = [int(r["variant"].split("t=")[1].replace(",", "")) for r in rows]
            ax.plot(ts, [r["/ optimum"] for r in rows], style, color=f"C{k}", label=f"{who}, c={c}")
    _log(ax)
    ax.set_xlabel("loop length t (unknown in advance; log scale)")
    ax.set_ylabel("body evaluations / offline optimum")
    ax.set_title(
        "Gradient through a while loop: recomputation against the offline optimum", fontsize=9
    )
    ax.legend(fontsize=7, ncol=3)
    return [(fig, "Body evaluations of the gradient, relative to the best schedule that knows t.")]


PLOTTERS: dict[str, Callable[[dict, Any], list[tuple[Figure, str]]]] = {
    "mlp": _plot_mlp,
    "lstm": _plot_lstm,
    "pairwise": _plot_pairwise,
    "pointcloud": _plot_pointcloud,
    "kip": _plot_kip,
    "linearize": _plot_linearize,
    "fit": _plot_fit,
    "sharding": _plot_sharding,
    "while_loop": _plot_while_loop,
}


def _png(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    return buffer.getvalue()


# --------------------------------------------------------------------------------------
# the page


def generate() -> dict[str, str | bytes]:
    """The page and every file it links to, as ``{path in the site: content}``."""
    import json

    run = _run_module()
    plt = _pyplot()
    preamble, sections = _sections(run.markdown())
    files: dict[str, str | bytes] = {}
    parts = [
        preamble.rstrip(),
        "",
        "The tables are BENCHMARKS.md's, generated from the same JSON files; "
        "the plots draw the same figures.",
    ]
    for name, text in sections:
        blocks = []
        result = json.loads((run.harness.RESULTS / f"{name}.json").read_text())
        for k, (fig, caption) in enumerate(PLOTTERS.get(name, lambda r, p: [])(result, plt)):
            path = f"{PLOTS}/{name}{'' if k == 0 else k + 1}.png"
            files[path] = _png(fig)
            plt.close(fig)
            blocks.append(f"![{caption}]({path}){{ loading=lazy }}\n\n*{caption}*")
        if blocks:
            text = _insert_after_first_paragraph(text, "\n\n".join(blocks))
        parts += ["", f"## {name}", text.rstrip()]
    page = "\n".join(parts) + "\n"
    # Images the notes themselves link to (``benchmarks/results/*.png``, relative to the
    # repository root where BENCHMARKS.md lives) are served at the same relative path.
    for link in re.findall(r"\]\((benchmarks/results/[^)\s]+\.png)\)", page):
        files[link] = (ROOT / link).read_bytes()
    files[PAGE] = page
    return files


def write(out_dir: Path) -> list[Path]:
    """Writes :func:`generate`'s files under ``out_dir``; returns their paths."""
    paths = []
    for rel, content in generate().items():
        path = Path(out_dir) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str):
            path.write_text(content)
        else:
            path.write_bytes(content)
        paths.append(path)
    return paths


def on_files(files: Any, config: Any) -> Any:
    """MkDocs event: add the generated page and images to the build."""
    from mkdocs.structure.files import File

    for rel, content in generate().items():
        files.append(File.generated(config, rel, content=content))
    return files


if __name__ == "__main__":
    for written in write(Path(sys.argv[1] if len(sys.argv) > 1 else "site-benchmarks")):
        print(written)
