"""memory_report / compiled_memory agree with XLA byte for byte and name user lines."""

import json
import os
import sys
import types

import _draw
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import memwise as mw
from memwise import _jax_private, measure

LOSS_LINE = None  # set below: the line of `jnp.tanh(h @ w)` in `mlp_loss`


def mlp_loss(params, x):
    h = x
    for w in params:
        h = jnp.tanh(h @ w)  # the residual source the report must name
    return jnp.sum(h**2)


with open(__file__) as _f:
    LOSS_LINE = next(i for i, line in enumerate(_f, 1) if "the residual source" in line)


def mlp_args(width=64, batch=32, depth=4):
    keys = jax.random.split(jax.random.PRNGKey(0), depth)
    params = [_draw.normal(k, (width, width)) / np.sqrt(width) for k in keys]
    return params, jnp.ones((batch, width))


def xla_stats(fn, *args):
    return jax.jit(fn).lower(*args).compile().memory_analysis()


@pytest.mark.parametrize("grad", [False, True])
def test_compiled_numbers_equal_memory_analysis(grad):
    args = mlp_args()
    report = mw.memory_report(mlp_loss, *args, grad=grad)
    stats = xla_stats(jax.grad(mlp_loss) if grad else mlp_loss, *args)
    assert report.temp_bytes == stats.temp_size_in_bytes
    assert report.argument_bytes == stats.argument_size_in_bytes
    assert report.output_bytes == stats.output_size_in_bytes
    assert report.alias_bytes == stats.alias_size_in_bytes
    reported = getattr(stats, "peak_memory_in_bytes", 0) or 0
    total = (
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        - stats.alias_size_in_bytes
        + stats.temp_size_in_bytes
    )
    assert report.peak_bytes == max(reported, total)


def test_stats_from_another_process_read_as_compiled():
    # The fields of memory_analysis() as plain numbers (what a peer library's program
    # in another venv sends back) give the same CompiledMemory as the compiled program.
    args = mlp_args()
    compiled = jax.jit(jax.grad(mlp_loss)).lower(*args).compile()
    stats = compiled.memory_analysis()
    names = [n for n in dir(stats) if n.endswith("_in_bytes")]
    sent = types.SimpleNamespace(**{n: int(getattr(stats, n)) for n in names})
    assert measure.CompiledMemory.from_stats(sent) == measure.CompiledMemory.from_compiled(compiled)
    assert measure.CompiledMemory.from_stats(sent).temp_bytes == stats.temp_size_in_bytes


def test_peak_counts_temporaries():
    # jaxlib's CPU peak_memory_in_bytes leaves temporaries out; ours must not.
    def row(r):
        m = jnp.sin(r[:, None] * r[None, :])
        return jnp.sum(m @ m)

    x = jnp.ones((256, 128))
    memory = measure.compiled_memory(lambda a: jax.lax.map(row, a, batch_size=256), x)
    assert memory.temp_bytes >= 256 * 128 * 128 * 4
    assert memory.peak_bytes >= memory.argument_bytes + memory.temp_bytes


def test_residuals_of_mlp_point_at_user_line():
    params, x = mlp_args()
    report = mw.memory_report(mlp_loss, params, x, grad=True)
    by_source = {r.source: r for r in report.residuals}
    line_source = f"{__file__}:{LOSS_LINE}"
    assert line_source in by_source, report.to_text()
    # four tanh outputs (32 x 64 f32) at least, from that one line, grouped
    assert by_source[line_source].count >= 4
    assert by_source[line_source].nbytes >= 4 * 32 * 64 * 4
    # the backward of layer k needs the weights of layers 1..3 and the input x
    assert "argument 'x'" in by_source
    # the leaves of `params` the backward needs (layers 1..3) are grouped under it
    assert by_source["argument 'params'"].count == 3
    assert by_source["argument 'params'"].nbytes == 3 * 64 * 64 * 4
    # largest first
    sizes = [r.nbytes for r in report.residuals]
    assert sizes == sorted(sizes, reverse=True)
    # total equals the residual avals JAX reports
    raw = measure.saved_residuals(mlp_loss, params, x, argnums=(0,))
    assert report.residual_bytes == sum(int(np.prod(a.shape)) * a.dtype.itemsize for a, _ in raw)


def test_residuals_only_for_requested_argnums():
    params, x = mlp_args()
    wrt_params = mw.memory_report(mlp_loss, params, x, grad=True, argnums=0)
    wrt_both = mw.memory_report(mlp_loss, params, x, grad=True, argnums=(0, 1))
    kept = {r.source: r.count for r in wrt_params.residuals}
    assert kept["argument 'params'"] == 3  # only dx would need W_0
    assert {r.source: r.count for r in wrt_both.residuals}["argument 'params'"] == 4


def scan_loss(w, xs):
    step = lambda h, x: (jnp.tanh(h @ w + x), None)
    h, _ = mw.scan(step, jnp.zeros(8), xs, checkpoints=3)  # scan line
    return jnp.sum(h)


def test_residuals_inside_memwise_code_point_at_caller():
    # memwise's own files count as library code: the checkpoint buffer mw.scan keeps is
    # attributed to the user's line that called mw.scan.
    report = mw.memory_report(scan_loss, jnp.eye(8), jnp.ones((50, 8)), grad=True)
    with open(__file__) as f:
        line = next(i for i, text in enumerate(f, 1) if text.rstrip().endswith("# scan line"))
    sources = [r.source for r in report.residuals]
    assert f"{__file__}:{line}" in sources, report.to_text()
    assert not any("memwise" in s and "tests" not in s for s in sources), sources
    # memwise's internal guard primitives are shown as what they hold
    whats = [r.what for r in report.residuals]
    assert any("checkpoint" in w for w in whats) and not any("memwise_" in w for w in whats)


def test_only_memwise_files_count_as_library_code():
    # The exclusion is a directory prefix: a sibling folder whose name starts with
    # "memwise" (memwise_experiments/) holds user code and keeps its line numbers.
    is_user = _jax_private._source_info_util.is_user_filename
    package = os.path.dirname(os.path.abspath(mw.__file__))
    assert not is_user(os.path.join(package, "scan.py"))
    assert not is_user(os.path.join(package, "measure", "report.py"))
    assert is_user(os.path.join(os.path.dirname(package), "memwise_experiments", "model.py"))
    assert is_user(package + "_experiments.py")


def test_constants_are_reported_and_warned():
    weights = jnp.asarray(np.random.default_rng(0).normal(size=(1024, 512)), jnp.float32)

    def closes_over(x):
        return jnp.sum(jnp.tanh(x @ weights))

    report = mw.memory_report(closes_over, jnp.ones((4, 1024)))
    assert report.constant_bytes == weights.nbytes
    assert "constants" in report.to_text() and "warning" in report.to_text()
    # passed as an argument, nothing is baked in and the program text is far smaller
    as_argument = mw.memory_report(
        lambda x, w: jnp.sum(jnp.tanh(x @ w)), jnp.ones((4, 1024)), weights
    )
    assert as_argument.constant_bytes == 0
    assert as_argument.program_bytes * 10 < report.program_bytes
    # a closure over parameters next to a batch of about their size (a linearized
    # network) still warns; a few constants next to large arguments do not
    batch = mw.memory_report(closes_over, jnp.ones((1024, 1024)))
    assert batch.argument_bytes > batch.constant_bytes and "warning" in batch.to_text()
    small = mw.memory_report(closes_over, jnp.ones((8192, 1024)))
    assert "warning" not in small.to_text()


def _warning(report):
    return next(line for line in report.to_text().splitlines() if "warning" in line)


def test_constants_warning_names_a_closed_over_linearized():
    # Closing over a mw.linearize result re-bakes its parameters into the program: the
    # warning names the object and says to pass it as an argument, not "use mw.linearize".
    params = {"w": jnp.asarray(np.random.default_rng(1).normal(size=(512, 512)), jnp.float32)}
    lin = mw.linearize(lambda p, x: jnp.tanh(x @ p["w"]), params)
    x = jnp.ones((4, 512))

    def step(new_params, x):
        return jnp.sum(lin(new_params, x) ** 2)

    warning = _warning(mw.memory_report(step, params, x, grad=True))
    assert "'lin', a mw.linearize result that 'step' closes over" in warning
    assert "as an argument" in warning and "1.0 MiB of them" in warning
    assert "keeps its parameters" not in warning

    # Reached through a loss the step calls, as an attribute of a callable object too.
    def outer(new_params, x):
        return 2 * step(new_params, x)

    class Model:
        def __init__(self):
            self.linearized = lin

        def __call__(self, new_params, x):
            return jnp.sum(self.linearized(new_params, x))

    assert "'lin', a mw.linearize result that 'step'" in _warning(
        mw.memory_report(outer, params, x)
    )
    assert "'self.linearized', a mw.linearize result that 'Model'" in _warning(
        mw.memory_report(Model(), params, x)
    )
    # Passed as an argument: no constants, no warning.
    as_argument = mw.memory_report(lambda p, lin, x: jnp.sum(lin(p, x)), params, lin, x)
    assert as_argument.constant_bytes == 0 and "warning" not in as_argument.to_text()


def test_constants_warning_names_other_closed_over_arrays():
    weights = jnp.ones((512, 512))
    f_jvp = jax.linearize(lambda x: jnp.tanh(x @ weights), jnp.ones((4, 512)))[1]

    def closes_over(x):
        return jnp.sum(x @ weights)

    def naive_linearized(t):  # jax.linearize's result is a pytree holding the weights
        return jnp.sum(f_jvp(t))

    warning = _warning(mw.memory_report(closes_over, jnp.ones((4, 512))))
    assert "held by 'weights' (1.0 MiB, closed over by 'closes_over')" in warning
    warning = _warning(mw.memory_report(naive_linearized, jnp.ones((4, 512))))
    assert "held by 'f_jvp'" in warning and "mw.linearize keeps its parameters" in warning


def test_to_text_and_to_dict():
    report = mw.memory_report(mlp_loss, *mlp_args(), grad=True)
    text = report.to_text()
    for word in ("peak", "temporaries", "residuals kept", "argument 'x'", "KiB"):
        assert word in text
    data = json.loads(json.dumps(report.to_dict()))
    assert data["peak_bytes"] == report.peak_bytes
    assert data["residuals"][0]["nbytes"] == report.residuals[0].nbytes
    assert data["residual_bytes"] == report.residual_bytes


def test_plot_writes_png(tmp_path):
    report = mw.memory_report(mlp_loss, *mlp_args(), grad=True)
    path = tmp_path / "r.png"
    report.plot(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_to_an_unknown_file_format_names_the_supported_ones(tmp_path):
    report = mw.memory_report(lambda x: jnp.sum(jnp.sin(x)), jnp.ones(8), grad=True)
    with pytest.raises(ValueError, match=r"matplotlib has no \.xyz format; .*\.png"):
        report.plot(tmp_path / "r.xyz")
    assert not (tmp_path / "r.xyz").exists()


def test_plot_without_matplotlib_says_how_to_install(monkeypatch, tmp_path):
    report = mw.memory_report(mlp_loss, *mlp_args(), grad=True)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pip install memwise\[plot\]"):
        report.plot(tmp_path / "r.png")


def test_shape_dtype_structs_compile_without_data():
    spec = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)
    memory = measure.compiled_memory(lambda x: jnp.sum(jnp.sin(x) ** 2), spec, grad=True)
    assert memory.argument_bytes == 4096 * 4096 * 4
    assert memory.output_bytes == 4096 * 4096 * 4


def layers_loss(x, n_layers, *, mode="sum", act=jnp.tanh):
    """A Python int used in range, a string option and a function: static arguments."""
    for _ in range(n_layers):
        x = act(x * 2.0)  # layers line
    return jnp.sum(x) if mode == "sum" else jnp.mean(x)


def test_static_arguments_are_passed_as_python_values():
    x = jnp.ones((16, 8))
    report = mw.memory_report(
        layers_loss,
        x,
        3,
        mode="mean",
        act=jnp.sin,
        grad=True,
        static_argnums=1,
        static_argnames=("mode", "act"),
    )
    bound = mw.memory_report(lambda x: layers_loss(x, 3, mode="mean", act=jnp.sin), x, grad=True)
    for field in ("peak_bytes", "temp_bytes", "argument_bytes", "output_bytes", "residual_bytes"):
        assert getattr(report, field) == getattr(bound, field), field
    assert report.name == "layers_loss"
    with open(__file__) as f:
        line = next(i for i, text in enumerate(f, 1) if text.rstrip().endswith("# layers line"))
    sources = {r.source for r in report.residuals}
    assert f"{__file__}:{line}" in sources and not any("argument" in s for s in sources)
    # a static name also marks its position, as in jax.jit; negative positions count back
    sizes = lambda m: (m.peak_bytes, m.temp_bytes, m.argument_bytes)
    by_name = measure.compiled_memory(layers_loss, x, 3, static_argnames=("n_layers",))
    by_position = measure.compiled_memory(layers_loss, x, 3, static_argnums=-1)
    bound = measure.compiled_memory(lambda x: layers_loss(x, 3), x)
    assert sizes(by_name) == sizes(by_position) == sizes(bound)
    # the executable takes the traced arguments, None in place of the static ones
    exe, _ = measure.compile_measured(layers_loss, x, 2, static_argnums=1)
    np.testing.assert_allclose(exe(x, None), layers_loss(x, 2), rtol=1e-6)


def test_static_argument_keeps_the_names_of_the_others():
    def loss(n_layers, x):
        return layers_loss(x, n_layers)

    report = mw.memory_report(loss, 2, jnp.ones(8), grad=True, argnums=1, static_argnums=0)
    assert report.residuals and all(r.source != "argument 'n_layers'" for r in report.residuals)
    kept = mw.measure.residuals(
        lambda n, x: jnp.sum(jnp.sin(x) * n), 2.0, jnp.ones(8), argnums=1, static_argnums=0
    )
    assert ("cos", (8,), "/") in [(r.what, r.shape, r.source[:1]) for r in kept]
    assert not any(r.source.startswith("argument") for r in kept)


X = jnp.ones(3)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: mw.memory_report(42, X), TypeError, "fn must be callable"),
        (lambda: mw.memory_report(jnp.sum, X, grad=1), TypeError, "grad must be True or False"),
        (
            lambda: mw.memory_report(jnp.sum, X, grad=True, argnums=3),
            ValueError,
            "argnums=3 is out of range",
        ),
        (
            lambda: mw.memory_report(jnp.sum, X, grad=True, argnums=True),
            TypeError,
            "argnums must be an int",
        ),
        (
            lambda: mw.memory_report(jnp.sum, X, grad=True, argnums="x"),
            TypeError,
            "argnums must be an int",
        ),
        (lambda: mw.memory_report(jnp.sin, X, grad=True), TypeError, "one scalar"),
        (
            lambda: mw.memory_report(lambda a: (jnp.sum(a), None), X, grad=True),
            TypeError,
            "one scalar array",
        ),
        (
            lambda: mw.memory_report(lambda a: {"loss": jnp.sum(a)}, X, grad=True),
            TypeError,
            "one scalar array",
        ),
        (
            lambda: mw.memory_report(lambda a: jnp.sum(a).astype(jnp.int32), X, grad=True),
            TypeError,
            "real float output",
        ),
        (
            lambda: mw.memory_report(lambda a: jnp.sum(a) * 1j, X, grad=True),
            TypeError,
            "real float output",
        ),
        (
            lambda: mw.memory_report(lambda a: jnp.sum(a * 1.0), jnp.arange(3), grad=True),
            TypeError,
            r"argument 0 \('a'\) has a leaf of dtype int32",
        ),
        (
            lambda: mw.memory_report(lambda p, x: jnp.sum(x), None, X, grad=True),
            ValueError,
            r"argument 0 \('p'\), which holds no arrays",
        ),
        (
            lambda: mw.memory_report(layers_loss, X, 2, mode="mean"),
            TypeError,
            r"keyword argument 'mode' is a str.*static_argnames=\('mode',\)",
        ),
        (
            lambda: mw.memory_report(lambda f, x: jnp.sum(f(x)), jnp.sin, X),
            TypeError,
            r"argument 0 \('f'\) is a .*static_argnums=\(0,\)",
        ),
        (
            lambda: mw.memory_report(lambda x, opts: jnp.sum(x), X, {"mode": "a"}),
            TypeError,
            r"argument 1 \('opts'\)\['mode'\] is a str",
        ),
        (
            lambda: mw.memory_report(layers_loss, X, 2),
            TypeError,
            r"argument 'n_layers' as a Python value.*static_argnums=\(1,\)",
        ),
        (
            lambda: mw.memory_report(layers_loss, X, 2, grad=True, argnums=1, static_argnums=1),
            ValueError,
            r"argnums=1 names argument 1 \('n_layers'\), which is static",
        ),
        (
            lambda: mw.memory_report(layers_loss, X, 2, static_argnums=5),
            ValueError,
            "static_argnums=5 is out of range",
        ),
        (
            lambda: mw.memory_report(layers_loss, X, 2, static_argnames=("depth",)),
            ValueError,
            r"static_argnames=\('depth',\) names no parameter",
        ),
        (
            lambda: mw.memory_report(layers_loss, X, 2, static_argnums=1.0),
            TypeError,
            "static_argnums must be an int",
        ),
        (
            lambda: mw.memory_report(layers_loss, X, 2, static_argnums=1, static_argnames=3),
            TypeError,
            "static_argnames must be a str",
        ),
        (lambda: measure.residuals(jnp.sum, X, argnums=2), ValueError, "argnums=2 is out of range"),
    ],
)
def test_bad_input_table(call, error, match):
    # Each bad input is a TypeError/ValueError naming the argument and the fix.
    with pytest.raises(error, match=match):
        call()


def test_zero_size_and_none_leaves_are_measured():
    empty = mw.memory_report(lambda a: jnp.sum(a**2), jnp.ones((0, 3)), grad=True)
    assert empty.argument_bytes == 0 and empty.residual_bytes == 0
    with_none = mw.memory_report(lambda p: jnp.sum(p["w"] ** 2), {"w": X, "b": None}, grad=True)
    assert with_none.argument_bytes == 12


def test_without_positional_arguments():
    # argnums only choose what a gradient differentiates; without grad they are ignored
    only_keywords = mw.memory_report(lambda *, x: x * 2, x=jnp.ones(3))
    assert only_keywords.output_bytes == 3 * 4 and only_keywords.residuals == ()
    constant = mw.memory_report(lambda: jnp.zeros(5))
    assert constant.argument_bytes == 0 and constant.output_bytes == 5 * 4
    assert measure.compiled_memory(lambda *, x: x * 2, x=jnp.ones(3)).output_bytes == 12
    with pytest.raises(ValueError, match=r"argnums=0.*no positional arguments"):
        mw.memory_report(lambda *, x: jnp.sum(x), x=jnp.ones(3), grad=True)
    with pytest.raises(ValueError, match="argnums"):
        measure.compiled_memory(lambda: jnp.float32(1.0), grad=True)


def test_residuals_equal_those_of_the_report():
    params, x = mlp_args()
    report = mw.memory_report(mlp_loss, params, x, grad=True, argnums=(0, 1))
    assert measure.residuals(mlp_loss, params, x, argnums=(0, 1)) == report.residuals


@pytest.mark.parametrize(
    "budget, expected",
    [
        (1024, 1024),
        ("8GiB", 8 * 2**30),
        ("512MB", 512 * 10**6),
        ("1.5 KiB", 1536),
        ("2gb", 2 * 10**9),
        (" 3 b ", 3),
        ("1e9", 10**9),
        ("1E3 kb", 10**6),
        ("1,000", 1000),
        ("1,000,000 B", 10**6),
        ("1_000", 1000),
        ("2.5GiB", int(2.5 * 2**30)),
        ("2.5 GB", 25 * 10**8),
        (".5 MiB", 2**19),
        ("+7", 7),
        (np.int64(5), 5),
    ],
)
def test_parse_budget(budget, expected):
    assert measure.parse_budget(budget) == expected


def test_parse_budget_fraction_of_device():
    device = measure.device_memory_bytes()
    assert 0 < measure.parse_budget(0.5) <= device
    assert measure.parse_budget(1.0) == device


@pytest.mark.parametrize(
    "budget, error",
    [
        (0, ValueError),
        (-5, ValueError),
        (1.5, ValueError),
        (0.0, ValueError),
        (1e9, ValueError),
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        ("lots", ValueError),
        ("abc", ValueError),
        ("5 parsecs", ValueError),
        ("0 MiB", ValueError),
        ("0", ValueError),
        ("-1", ValueError),
        ("-2GiB", ValueError),
        ("nan", ValueError),
        ("inf", ValueError),
        ("1e400", ValueError),
        ("0.4", ValueError),
        ("1,00", ValueError),
        ("1__0", ValueError),
        ("", ValueError),
        ("GiB", ValueError),
        (None, TypeError),
        (True, TypeError),
        ([1], TypeError),
    ],
)
def test_bad_budgets(budget, error):
    with pytest.raises(error, match="budget") as raised:
        measure.parse_budget(budget)
    assert "'8GiB'" in str(raised.value) and "'1e9'" in str(raised.value)  # accepted forms


def test_format_bytes():
    assert measure.format_bytes(0) == "0 B"
    assert measure.format_bytes(1536) == "1.5 KiB"
    assert measure.format_bytes(3 * 2**30) == "3.0 GiB"


def test_a_derivative_helper_is_named_for_the_operation_it_differentiates():
    # jnp.tanh keeps tanh(x) and 1 - tanh(x); JAX names the second "sub", which is not in
    # the user's code. h ** 2 keeps 2 * h ("mul"). A helper with a telling name keeps it
    # (sin keeps cos), and the user's own arithmetic that a later operation needs stays
    # itself (log keeps its input, exp(x) - 0.5).
    def layer(w, x):
        h = jnp.tanh(x @ w)  # tanh line
        return jnp.sum(h**2)  # square line

    kept = {r.what for r in mw.measure.residuals(layer, jnp.ones((4, 4)), jnp.ones((2, 4)))}
    assert kept == {"tanh, tanh derivative", "integer_pow derivative", "argument"}, kept
    sin = mw.measure.residuals(lambda x: jnp.sum(jnp.sin(x)), jnp.ones(8))
    assert [r.what for r in sin] == ["cos"]
    own = mw.measure.residuals(lambda x: jnp.sum(jnp.log(jnp.exp(x) - 0.5)), jnp.ones(8))
    assert [r.what for r in own] == ["exp, sub"]
    sigmoid = mw.measure.residuals(lambda x: jnp.sum(jax.nn.sigmoid(x)), jnp.ones(8))
    assert [r.what for r in sigmoid] == ["logistic derivative"]


def test_host_memory_is_left_out_of_the_devices_peak():
    # jaxlib 0.10.2 on a TPU, an offloaded nested scan's gradient (measured): 52.4 MB of
    # carries in host memory, counted in peak_memory_in_bytes beside the device's bytes;
    # the same program with its carries on the device reports 63.3 MB.
    stats = types.SimpleNamespace(
        argument_size_in_bytes=4_456_448,
        output_size_in_bytes=4_194_304,
        alias_size_in_bytes=0,
        temp_size_in_bytes=0,
        host_argument_size_in_bytes=0,
        host_output_size_in_bytes=0,
        host_alias_size_in_bytes=0,
        host_temp_size_in_bytes=52_428_800,
        peak_memory_in_bytes=63_191_040,
    )
    memory = measure.CompiledMemory.from_stats(stats)
    assert memory.host_bytes == 52_428_800
    assert memory.peak_bytes == 63_191_040 - 52_428_800
    # a peak that could not hold the host's bytes is the device's already
    stats.peak_memory_in_bytes = 20_000_000
    assert measure.CompiledMemory.from_stats(stats).peak_bytes == 20_000_000
    # no host memory: unchanged (a CPU's stats)
    stats.host_temp_size_in_bytes, stats.peak_memory_in_bytes = 0, 63_320_576
    assert measure.CompiledMemory.from_stats(stats).peak_bytes == 63_320_576
    # a host alias alone (hand-written stats) is no negative host memory
    stats.host_alias_size_in_bytes = 40
    memory = measure.CompiledMemory.from_stats(stats)
    assert (memory.host_bytes, memory.peak_bytes) == (0, 63_320_576)
