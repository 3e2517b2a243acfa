"""Every Python example in the documentation runs: README.md and docs/**/*.md.

Each Markdown file's fenced ``python`` blocks run in order in one namespace, like the
cells of a notebook, with a fresh namespace per file, in a temporary working directory
(examples write plots), with matplotlib on its Agg backend and the network off.
Tracebacks and ``mw.memory_report`` source columns point at the Markdown line.

A block whose fence sits right below a ``<!-- illustrative -->`` line is not run (it
needs the user's own model or data, or runs at a size this suite cannot afford).
``ILLUSTRATIVE`` lists every such block with its reason, and the suite fails on a
skipped block that is not listed or a listed one that is no longer skipped, so nothing
is skipped silently. Files in ``MULTI_DEVICE`` run in a subprocess that sees 8 CPU
devices (as tests/_multidevice.py runs the other multi-device tests). Shell blocks
(``python -m memwise.launch ...``) are never run.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import re
import socket
import sys
import textwrap
import types
from pathlib import Path

import pytest
from _multidevice import run_on_devices

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent

# OTT-JAX imports JAXopt, which warns that it is no longer maintained.
pytestmark = pytest.mark.filterwarnings("ignore:JAXopt is no longer maintained:DeprecationWarning")

# The pages this suite owns; each must exist and run at least one block.
GUIDES = [
    "docs/guides/long-loops.md",
    "docs/guides/pairwise-and-attention.md",
    "docs/guides/language-model-loss.md",
    "docs/guides/optimal-transport.md",
    "docs/guides/linearized-ntk-kip.md",
    "docs/guides/from-neural-tangents.md",
    "docs/guides/fitting-a-budget.md",
    "docs/guides/many-devices.md",
]

# Files whose examples need several devices: run with this many virtual CPU devices.
MULTI_DEVICE = {"docs/guides/many-devices.md": 8}

# Every block marked <!-- illustrative --> (not run), keyed by (file, first code line):
# the block's first line that is not blank, a comment or an import.
ILLUSTRATIVE: dict[tuple[str, str], str] = {
    ("README.md", "def sample_points_uniformly_from_disc(r, n, key):"): (
        "the OTT-JAX issue 417 program at the report's size, 50,000 points (about four "
        "minutes on 2 CPU cores); the optimal-transport guide runs it at 2,000 points"
    ),
    ("README.md", "def vit_apply(params, inputs):"): (
        "the neural-tangents issue 144 update step needs the user's ViT, loss, schedule "
        "and data pipeline; the linearized-networks guide runs it on a small Flax model"
    ),
    ("README.md", "k = ntk.kernels"): (
        "the KIP gradient over the user's 60,000 MNIST targets; the NTK and KIP guide "
        "runs the same calls on small arrays"
    ),
    ("README.md", "pool = k.AvgPool((2, 2), strides=(2, 2))"): (
        "the Myrtle KIP gradient over the user's MNIST arrays: pooling kernels cost "
        "(H*W)^2 per pair of images, too slow for CPU tests even small (the NTK and KIP "
        "guide runs the conv kernel and quotes the Myrtle figures)"
    ),
    ("README.md", "mean, cov = ntk.predict("): (
        "continues the KIP example on the user's MNIST arrays; the NTK and KIP guide runs "
        "ntk.predict on small arrays"
    ),
    (
        "docs/guides/language-model-loss.md",
        'mesh = jax.make_mesh((2, 4), ("data", "model"))  # 8 devices',
    ): (
        "needs 8 devices (a 2 x 4 mesh); tests/test_cross_entropy.py runs the same calls "
        "on 8 CPU devices against one device"
    ),
    ("docs/guides/optimal-transport.md", "@jax.jit"): (
        "the OTT-JAX issue 417 program with OTT's online mode (batch_size=), which fails "
        "on current JAX inside OTT-JAX 0.6 (the guide quotes the issue's and the "
        "benchmark's figures, and runs OTT's dense point cloud instead)"
    ),
    ("docs/guides/linearized-ntk-kip.md", "_, _, kernel_fn = stax.serial("): (
        "the KIP notebook's loss on neural-tangents, which does not import on current JAX "
        "(the guide quotes neural-tangents 0.6.5's figures and runs memwise's kernels)"
    ),
}

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`]*)$")
_ILLUSTRATIVE_MARK = re.compile(r"^<!--\s*illustrative\s*-->$")


@dataclasses.dataclass(frozen=True)
class Block:
    path: str  # relative to the repository root
    line: int  # 1-based line of the first code line
    language: str
    code: str
    illustrative: bool

    @property
    def first_line(self) -> str:
        """The first line that is not blank, a comment or an import (else the first)."""
        lines = [s.strip() for s in self.code.splitlines() if s.strip()]
        code = [s for s in lines if not re.match(r"(#|import\s|from\s+\S+\s+import\s)", s)]
        return (code or lines or [""])[0]


def blocks(path: str) -> list[Block]:
    """The fenced code blocks of a Markdown file, in order."""
    lines = (ROOT / path).read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, fence = match["indent"], match["fence"]
        language = (match["info"].split() or [""])[0].strip("{}.").lower()
        end = i + 1
        while end < len(lines) and not re.fullmatch(
            rf"[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*", lines[end]
        ):
            end += 1
        body = [
            s[len(indent) :] if s.startswith(indent) else s.lstrip() for s in lines[i + 1 : end]
        ]
        above = lines[i - 1].strip() if i else ""
        found.append(
            Block(path, i + 2, language, "\n".join(body), bool(_ILLUSTRATIVE_MARK.match(above)))
        )
        i = end + 1
    return found


def python_blocks(path: str) -> list[Block]:
    return [b for b in blocks(path) if b.language in ("python", "py")]


def documentation_files() -> list[str]:
    docs = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md"))
    return ["README.md", *docs]


def _unlisted_and_stale(path: str) -> tuple[list[str], list[str]]:
    keys = [(b.path, b.first_line) for b in python_blocks(path) if b.illustrative]
    twins = sorted({key for key in keys if keys.count(key) > 1})
    assert not twins, f"illustrative blocks that share a first code line: {twins}"
    skipped = set(keys)
    listed = {key for key in ILLUSTRATIVE if key[0] == path}
    unlisted = [f"{p}: {first!r}" for p, first in sorted(skipped - listed)]
    stale = [f"{p}: {first!r}" for p, first in sorted(listed - skipped)]
    return unlisted, stale


@contextlib.contextmanager
def _no_network():
    def refuse(*args, **kwargs):
        raise RuntimeError("a documentation example tried to use the network")

    saved = (socket.socket.connect, socket.socket.connect_ex, socket.create_connection)
    socket.socket.connect = refuse  # type: ignore[method-assign]
    socket.socket.connect_ex = refuse  # type: ignore[method-assign]
    socket.create_connection = refuse  # type: ignore[assignment]
    try:
        yield
    finally:
        socket.socket.connect, socket.socket.connect_ex, socket.create_connection = saved


@contextlib.contextmanager
def _restored_jax_config():
    # An example may switch on float64 or another flag; later files must not see it.
    import jax

    before = dict(jax.config.values)
    try:
        yield
    finally:
        for name, value in before.items():
            if jax.config.values.get(name) != value:
                jax.config.update(name, value)


def run_file(path: str, workdir: str) -> int:
    """Run the file's non-illustrative Python blocks in one fresh namespace; return how many."""
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    module = types.ModuleType("docs_example")
    module.__file__ = str(ROOT / path)
    sys.modules[module.__name__] = module
    cwd = os.getcwd()
    ran = 0
    os.chdir(workdir)
    try:
        with _no_network(), _restored_jax_config():
            for block in python_blocks(path):
                if block.illustrative:
                    continue
                # Pad so that line numbers in tracebacks and reports are the file's.
                source = "\n" * (block.line - 1) + block.code
                exec(compile(source, path, "exec"), module.__dict__)
                ran += 1
                plt.close("all")
    finally:
        os.chdir(cwd)
        sys.modules.pop(module.__name__, None)
    return ran


@pytest.mark.parametrize("path", documentation_files())
@pytest.mark.slow
def test_examples_run(path, tmp_path):
    unlisted, stale = _unlisted_and_stale(path)
    assert not unlisted, f"illustrative blocks not listed in ILLUSTRATIVE: {unlisted}"
    assert not stale, f"ILLUSTRATIVE entries whose block is run or gone: {stale}"
    devices = MULTI_DEVICE.get(path)
    if devices is None:
        ran = run_file(path, str(tmp_path))
    else:
        code = f"""
            import sys
            sys.path.insert(0, {str(TESTS)!r})
            import test_docs
            print("ran", test_docs.run_file({path!r}, {str(tmp_path)!r}))
        """
        out = run_on_devices(textwrap.dedent(code), n_devices=devices, timeout=600)
        ran = int(out.strip().splitlines()[-1].split()[-1])
    if path in GUIDES:
        assert ran > 0, f"{path} has no example that runs"


def test_every_illustrative_block_is_listed_with_a_reason():
    files = documentation_files()
    for path in files:
        unlisted, stale = _unlisted_and_stale(path)
        assert not unlisted, f"illustrative blocks not listed in ILLUSTRATIVE: {unlisted}"
        assert not stale, f"ILLUSTRATIVE entries whose block is run or gone: {stale}"
    assert all(path in files for path, _ in ILLUSTRATIVE), "ILLUSTRATIVE names a missing file"
    assert all(reason.strip() for reason in ILLUSTRATIVE.values()), "every skip needs a reason"


def test_the_guides_exist():
    missing = [path for path in GUIDES if not (ROOT / path).exists()]
    assert not missing, f"guides missing: {missing}"


def _imported_and_bound(tree: ast.AST) -> tuple[set[str], set[str]]:
    """(names bound by imports, every name the code binds) of a parsed block."""
    imported, bound = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                name = alias.asname or alias.name.split(".")[0]
                imported.add(name)
                bound.add(name)
        elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return imported, bound


def test_readme_blocks_that_open_with_imports_stand_alone():
    # The suite runs a file's blocks in one namespace, so a block that uses `jax` without
    # importing it passes here and fails with a NameError when pasted alone. A README
    # block that opens with imports is one a reader pastes alone: it imports every module
    # it uses (a module: a name some README block imports).
    parsed = [(b, ast.parse(b.code)) for b in python_blocks("README.md")]
    modules = set().union(*(_imported_and_bound(tree)[0] for _, tree in parsed))
    missing = {}
    for block, tree in parsed:
        if not tree.body or not isinstance(tree.body[0], (ast.Import, ast.ImportFrom)):
            continue
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        unbound = sorted((used & modules) - _imported_and_bound(tree)[1])
        if unbound:
            missing[f"README.md:{block.line}"] = unbound
    assert not missing, f"blocks that use modules they do not import: {missing}"


def test_the_api_pages_list_bare_names_and_examples_fit_their_box():
    # The contents list of an API page shows the public name without the package (long
    # labels were cut by the theme), and no docstring example line is wider than the
    # rendered code box (80 columns with the docstring's indent): it would scroll.
    root = Path(__file__).resolve().parent.parent
    labels = re.findall(
        r"toc_label:\s*(\S+)",
        "".join(p.read_text() for p in sorted((root / "docs" / "api").glob("*.md"))),
    )
    assert labels and not [label for label in labels if label.startswith("memwise.")]
    wide = []
    for path in sorted((root / "src" / "memwise").rglob("*.py")):
        if any(part.startswith("_") and part != "__init__.py" for part in path.parts):
            continue  # private modules: not on the API pages
        indent = 0  # of the example's >>> lines: what the page strips
        for number, line in enumerate(path.read_text().splitlines(), 1):
            example = re.match(r"(\s*)(>>>|\.\.\.)( |$)", line)
            if example and example.group(2) == ">>>":
                indent = len(example.group(1))
            if example and len(line) - indent > 80:
                wide.append(f"{path.relative_to(root)}:{number}")
    assert not wide, wide
