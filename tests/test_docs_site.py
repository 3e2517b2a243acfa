"""The documentation site: the API reference covers every public name, the Benchmarks
page and its plots are generated from the committed results, the changelog is included.

``mkdocs build --strict`` (``make docs``) checks the rest: every ``::: identifier``
renders, docstrings parse, links resolve.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import re
import sys
import types
from pathlib import Path

import pytest

import memwise
from memwise._display import format_bytes

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
API = DOCS / "api"

# Public modules besides those reachable through ``__all__`` (``memwise.ot``,
# ``memwise.ntk.kernels``, ...): the Flax adapters, the Diffrax adjoint, and the modules
# whose objects users receive or pass (``fit``'s ``Fitted``/``Plan``, ``report.timeline()``'s ``Timeline``,
# ``chunk_size=Tiling(...)``, the roofline behind ``fit``).
EXTRA_PUBLIC_MODULES = [
    "memwise.flax",
    "memwise.diffrax",
    "memwise.fit",
    "memwise.timeline",
    "memwise.tiling",
    "memwise.costmodel",
    "memwise.nt",
]


def _directives() -> set[str]:
    """Every ``::: identifier`` of the API pages."""
    found = set()
    for page in API.glob("*.md"):
        found |= set(re.findall(r"^::: *(\S+)", page.read_text(), flags=re.M))
    return found


def _public_modules() -> list[str]:
    """``memwise``, every module named in a public module's ``__all__``, and the extras."""
    names, queue = [], ["memwise", *EXTRA_PUBLIC_MODULES]
    while queue:
        name = queue.pop(0)
        if name in names:
            continue
        names.append(name)
        module = importlib.import_module(name)
        module = sys.modules[name]  # memwise.fit the module, not the function
        for member in module.__all__:
            value = getattr(module, member)
            if isinstance(value, types.ModuleType):
                queue.append(value.__name__)
    return names


def _documents(module: str, member: str, directives: set[str]) -> bool:
    """Whether a directive documents ``module.member``: that path, or one that names the
    same module, class or function (``memwise.MemoryReport`` is
    ``memwise.measure.MemoryReport``)."""
    if f"{module}.{member}" in directives:
        return True
    value = getattr(sys.modules[module], member)
    if not (inspect.ismodule(value) or inspect.isclass(value) or callable(value)):
        return False  # a constant: only its own path names it
    return any(_resolve(d) is value for d in directives)


def _find_spec(name: str) -> object:
    try:
        return importlib.util.find_spec(name)
    except ImportError:  # a parent that is a module, not a package
        return None


def _resolve(identifier: str) -> object:
    """The object a directive names, importing its module (``memwise.fit.fit``: the
    function in the module ``memwise.fit``, as Griffe reads it)."""
    parts = identifier.split(".")
    for k in range(len(parts), 0, -1):
        name = ".".join(parts[:k])
        if _find_spec(name) is None:
            continue
        obj: object = importlib.import_module(name)
        obj = sys.modules[name]
        for attr in parts[k:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(identifier)


def test_every_public_name_has_an_api_entry():
    directives = _directives()
    missing = [
        f"{module}.{member}"
        for module in _public_modules()
        for member in sys.modules[module].__all__
        if not _documents(module, member, directives)
    ]
    assert not missing, f"public names missing from docs/api/*.md: {missing}"


def test_every_public_module_is_introduced():
    directives = _directives()
    missing = [m for m in _public_modules() if m != "memwise" and m not in directives]
    assert not missing, f"public modules without a '::: module' entry: {missing}"


def test_every_api_entry_names_an_object():
    for identifier in sorted(_directives()):
        try:
            _resolve(identifier)
        except (ImportError, AttributeError) as error:
            pytest.fail(f"'::: {identifier}' names nothing importable: {error!r}")


def test_api_entries_are_not_private():
    private = [d for d in _directives() if any(p.startswith("_") for p in d.split("."))]
    assert not private, private


# --------------------------------------------------------------------------------------
# the Benchmarks page


@pytest.fixture(scope="module")
def benchmarks_hook():
    spec = importlib.util.spec_from_file_location(
        "_docs_benchmarks_hook", DOCS / "hooks" / "benchmarks.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generated(benchmarks_hook, tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    benchmarks_hook.write(out)
    return out, (out / benchmarks_hook.PAGE).read_text()


def _results() -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in (ROOT / "benchmarks/results").glob("*.json")}


@pytest.mark.slow
def test_benchmarks_page_has_a_plot_for_each_plotted_result(benchmarks_hook, generated):
    out, page = generated
    plotted = sorted(set(_results()) & set(benchmarks_hook.PLOTTERS))
    assert plotted, "no results with a plot"
    for name in plotted:
        png = out / benchmarks_hook.PLOTS / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
        assert f"]({benchmarks_hook.PLOTS}/{name}.png)" in page, name


def test_benchmarks_page_images_exist(generated):
    out, page = generated
    links = re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", page)
    assert links
    for link in links:
        assert (out / link).is_file(), link


def test_benchmarks_page_shows_every_table(generated):
    _, page = generated
    for name, result in _results().items():
        assert f"\n## {name}\n" in page, name
        for table in result["tables"]:
            if not table.get("rows"):  # a case that failed or did not run says why
                assert table["failure"] in page, table
                continue
            assert f"**{table['title']}**" in page, table["title"]
            first = table["rows"][0]
            if table.get("columns"):  # a table naming its own columns: its first cell
                assert f"| {first[table['columns'][0][0]]} |" in page, table["title"]
                continue
            # the memory column of the first row, as BENCHMARKS.md formats it
            assert f"| {first['variant']} | {format_bytes(first['temp_bytes'])} |" in page


def test_benchmarks_page_quotes_the_lstm_figure(generated):
    # lax.scan's gradient temp for the Flax LSTM at T=10,000 (benchmarks/results/lstm.json)
    _, page = generated
    assert "| lax.scan (nn.scan) | 598.7 MiB |" in page


# --------------------------------------------------------------------------------------
# changelog and the docstring rewriting


def test_changelog_is_included_and_has_this_version():
    assert '--8<-- "CHANGELOG.md"' in (DOCS / "changelog.md").read_text()
    release = re.match(r"\d+\.\d+\.\d+", memwise.__version__)[0]
    assert f"## {release}" in (ROOT / "CHANGELOG.md").read_text()


def test_docstring_literal_blocks_become_markdown():
    spec = importlib.util.spec_from_file_location(
        "_docs_griffe_docstrings", DOCS / "hooks" / "griffe_docstrings.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = inspect.cleandoc(
        """Summary.

        Example::

            >>> 1 + 1
            2

        So the fix is one line::

            y = f(x)
        """
    )
    rewritten = module._literal_blocks(text)
    assert "Examples:\n    >>> 1 + 1\n    2" in rewritten
    assert "So the fix is one line:\n\n```python\ny = f(x)\n```" in rewritten
    assert "::" not in rewritten
