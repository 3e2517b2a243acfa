"""The memwise command: demo, report (file and module factories), bench, errors."""

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from memwise import cli, scenarios

USER_FILE = textwrap.dedent(
    """
    import jax, jax.numpy as jnp

    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w) ** 2)  # user line

    def factory():
        return loss, (jnp.ones((32, 32)), jnp.ones((8, 32)))

    def with_kwargs():
        return (lambda x, scale: jnp.sum(x * scale)), (jnp.ones(4),), {"scale": 2.0}

    def not_a_tuple():
        return 1

    def nonscalar():
        return (lambda x: x * 2), (jnp.ones(4),)

    def not_callable():
        return 3, (jnp.ones(4),)

    def args_an_array():
        return loss, jnp.ones(4)

    def kwargs_a_list():
        return loss, (jnp.ones(4),), [1]

    def four_items():
        return loss, (jnp.ones(4),), {}, 5

    def with_static():
        def layers(x, n_layers, mode="sum"):
            for _ in range(n_layers):
                x = jnp.tanh(x @ x)
            return jnp.sum(x) if mode == "sum" else jnp.mean(x)

        return layers, (jnp.ones((8, 8)), 3), {"mode": "mean"}

    def buggy():
        return (lambda x: jnp.sum(x.no_such_attribute)), (jnp.ones(4),)
    """
)


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "user_model.py"
    path.write_text(USER_FILE)
    return path


def test_report_from_file(user_file, capsys):
    assert cli.main(["report", f"{user_file}:factory", "--grad"]) == 0
    out = capsys.readouterr().out
    assert "gradient of loss" in out
    assert f"{user_file}:5" in out  # the tanh line


def test_report_json_and_plot(user_file, capsys, tmp_path):
    plot = tmp_path / "r.png"
    assert (
        cli.main(["report", f"{user_file}:factory", "--grad", "--json", "--plot", str(plot)]) == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["grad"] is True and data["peak_bytes"] > 0
    assert plot.exists()


def test_report_module_factory_with_kwargs(user_file, capsys, monkeypatch):
    monkeypatch.chdir(user_file.parent)
    assert cli.main(["report", "user_model:with_kwargs"]) == 0
    assert "peak" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["no_colon"], "MODULE:FACTORY"),
        (["{file}:missing"], "has no function 'missing'"),
        (["{file}:not_a_tuple"], r"not_a_tuple\(\) must return .*got int"),
        (
            ["{file}:loss"],  # the function instead of its factory
            r"loss takes arguments \(w, x\), but FACTORY must be a zero-argument function "
            r"returning \(fn, args\)",
        ),
        (["/nope/x.py:f"], "no such file"),
        (["{folder}/notes.txt:f"], "cannot load .*notes.txt' as Python code"),
        (["no_such_module_xyz:factory"], "cannot import 'no_such_module_xyz'.*run memwise from"),
        (["{imports_missing}:factory"], "no module named 'no_such_dependency_xyz'.*install it"),
        (["{file}:factory", "--budget", "abc"], "--budget: cannot read budget 'abc'.*'8GiB'"),
        (["{file}:factory", "--budget", "-1"], "--budget: budget must be .* got '-1'"),
        (["{file}:factory", "--budget", "0"], "--budget: budget must be"),
        (["{file}:nonscalar", "--grad"], "one scalar array.*drop --grad"),
        (["{file}:not_callable"], "fn must be callable"),
        # An array as args was iterated into one argument per row ("takes 2 positional
        # arguments but 4 were given").
        (
            ["{file}:args_an_array"],
            r"args a tuple of fn's arguments \(for one argument: \(x,\)\), got ArrayImpl",
        ),
        (["{file}:kwargs_a_list"], "kwargs a dict, got list"),
        (["{file}:four_items"], r"got a tuple of 4"),
        (
            ["{file}:factory", "--plot", "/no/such/folder/r.png"],
            "cannot write --plot.*does not exist",
        ),
        (["{file}:factory", "--plot", "{folder}"], "cannot write --plot.*is a folder"),
        (
            ["{file}:factory", "--plot", "{folder}/r.xyz"],
            r"cannot write --plot .*r\.xyz': matplotlib has no \.xyz format; .*\.png, \.ps",
        ),
    ],
)
def test_report_usage_errors_are_one_line_with_status_2(user_file, argv, message, capsys):
    imports_missing = user_file.parent / "imports_missing.py"
    imports_missing.write_text("import no_such_dependency_xyz\n")
    (user_file.parent / "notes.txt").write_text("def f():\n    pass\n")
    argv = [
        a.format(file=user_file, imports_missing=imports_missing, folder=user_file.parent)
        for a in argv
    ]
    assert cli.main(["report", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    assert captured.err.startswith("memwise report: ") and captured.err.count("\n") == 1
    assert re.search(message, captured.err), captured.err


@pytest.mark.slow
def test_usage_errors_from_a_shell(tmp_path):
    # The real process: one line on stderr, exit status 2, no traceback.
    for argv in (
        ["report", "no_such_module_xyz:factory"],
        ["report", "no_such_module_xyz:factory", "--budget", "1e9xyz"],
    ):
        result = subprocess.run(
            [sys.executable, "-m", "memwise", *argv],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
            check=False,
        )
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1


def test_errors_in_the_users_code_keep_their_traceback(user_file):
    with pytest.raises(AttributeError, match="no_such_attribute"):
        cli.main(["report", f"{user_file}:buggy"])


def test_report_non_array_arguments_are_static(user_file, capsys):
    assert cli.main(["report", f"{user_file}:with_static", "--grad"]) == 0
    assert "gradient of layers" in capsys.readouterr().out
    assert cli.main(["report", f"{user_file}:with_static", "--grad", "--budget", "1e9"]) == 0
    out = capsys.readouterr().out
    assert "plan: peak" in out and "within budget 953.7 MiB" in out


@pytest.mark.slow
def test_demo_prints_table(capsys, tmp_path):
    plot = tmp_path / "demo.png"
    assert cli.main(["demo", "mlp", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "naive peak" in out and "memwise peak" in out
    row = next(line for line in out.splitlines() if line.startswith("mlp "))
    assert " yes " in row
    assert plot.exists()


def test_demo_table_leads_with_what_differs(capsys, tmp_path):
    # A scenario about baked-in constants (a linearized network) is headlined by them,
    # not by a peak ratio below 1 that its naive program reaches only by leaving them out.
    kib = 1024
    rows = [
        dict(
            scenario="mlp",
            headline="peak",
            naive_peak=176 * kib * kib,
            memwise_peak=47 * kib * kib,
            naive_constants=0,
            memwise_constants=1126,
        ),
        dict(
            scenario="linearize",
            headline="constants",
            naive_peak=943 * kib,
            memwise_peak=1126 * kib,
            naive_constants=78_234,
            memwise_constants=0,
        ),
    ]
    for row in rows:
        row.update(description="d", agree="yes", seconds=1.0)
    cli._print_demo_table(rows)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("scenario   memwise vs naive  ")
    assert lines[2].split()[:4] == ["mlp", "peak", "3.7x", "lower"]
    assert lines[3].split()[:6] == ["linearize", "constants", "76.4", "KiB", "->", "0"]
    assert "x " not in lines[3].split("->")[0]  # no peak ratio for it
    cli._plot_demo(rows, str(tmp_path / "demo.svg"))
    assert "constants 76.4 KiB -&gt; 0 B" in (tmp_path / "demo.svg").read_text()


@pytest.mark.slow
def test_linearize_scenario_is_headlined_by_the_constants_it_removes():
    row = cli._demo_row("linearize", "default")
    assert row["headline"] == "constants" and row["agree"] == "yes"
    assert row["naive_constants"] > 50 * 1024 and row["memwise_constants"] == 0
    assert cli._headline(row).endswith("-> 0 B")


def test_scenario_headline_is_checked():
    with pytest.raises(ValueError, match="headline must be one of"):
        scenarios.Scenario("x", "d", abs, abs, (), headline="speed")


def test_demo_unknown_scenario(capsys):
    assert cli.main(["demo", "nope"]) == 2
    assert "unknown scenario" in capsys.readouterr().err


def test_scenarios_registry():
    assert "mlp" in scenarios.available()
    with pytest.raises(ValueError, match="size must be one of"):
        scenarios.load("mlp", "huge")


@pytest.mark.parametrize("size", ["report", "seed"])
def test_demo_size_report_and_its_older_name_seed(size, monkeypatch):
    # Both values pick the sizes of the original user reports; nothing is built here.
    calls = []
    monkeypatch.setattr(cli, "demo", lambda names, size, plot: calls.append(size) or 0)
    assert cli.main(["demo", "mlp", "--size", size]) == 0
    assert calls == [size]
    from memwise.scenarios import mlp

    monkeypatch.setattr(mlp, "make", lambda **size: size)
    assert scenarios.load("mlp", size) == mlp.SIZES["report"]


@pytest.mark.slow
def test_python_dash_m_and_console_script(user_file):
    for command in (
        [sys.executable, "-m", "memwise"],
        [str(Path(sys.executable).parent / "memwise")],
    ):
        result = subprocess.run(
            [*command, "report", f"{user_file}:factory"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        assert "memory report" in result.stdout


def test_bench_markdown_only(monkeypatch):
    calls = []
    monkeypatch.setattr(cli.subprocess, "call", lambda cmd: calls.append(cmd) or 0)
    assert cli.main(["bench", "mlp", "--quick"]) == 0
    assert calls[0][-2:] == ["mlp", "--quick"]
    assert calls[0][1].endswith("benchmarks/run.py")


def test_report_with_budget_prints_plan_and_fitted_report(user_file, capsys):
    assert cli.main(["report", f"{user_file}:factory", "--grad", "--budget", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert "plan: peak" in out and "within budget 1.0 GiB" in out
    assert "policy (whole loss)" in out
    assert "gradient of loss" in out


def test_report_with_impossible_budget_says_why(user_file, capsys):
    assert cli.main(["report", f"{user_file}:factory", "--grad", "--budget", "1KiB"]) == 1
    assert "smallest peak reached" in capsys.readouterr().err


def test_report_timeline_text_json_and_plot(user_file, capsys, tmp_path):
    assert cli.main(["report", f"{user_file}:factory", "--grad", "--timeline"]) == 0
    out = capsys.readouterr().out
    assert "memory timeline: gradient of loss" in out and "buffers alive at the peak" in out
    assert f"{user_file}:5" in out.split("memory timeline")[1]  # the tanh line, again
    plot = tmp_path / "timeline.svg"
    assert (
        cli.main(
            [
                "report",
                f"{user_file}:factory",
                "--grad",
                "--timeline",
                "--json",
                "--plot",
                str(plot),
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["timeline"]["peak_bytes"] == max(data["timeline"]["live_bytes"]) > 0
    assert "live memory along the compiled schedule" in plot.read_text()


def test_report_writes_both_plots_in_one_call(user_file, capsys, tmp_path):
    residuals, timeline = tmp_path / "residuals.svg", tmp_path / "timeline.svg"
    argv = ["report", f"{user_file}:factory", "--grad", "--plot", str(residuals)]
    assert cli.main([*argv, "--timeline-plot", str(timeline)]) == 0
    assert "memory timeline" in capsys.readouterr().out  # --timeline-plot implies it
    assert "MiB kept for the backward pass" in residuals.read_text()
    assert "live memory along the compiled schedule" in timeline.read_text()
    # --plot stays the residuals' chart with --timeline when --timeline-plot is given
    residuals.unlink()
    assert cli.main([*argv, "--timeline", "--timeline-plot", str(timeline)]) == 0
    assert "MiB kept for the backward pass" in residuals.read_text()
    capsys.readouterr()
    assert cli.main([*argv, "--timeline-plot", str(residuals)]) == 2
    assert "both name" in capsys.readouterr().err
    assert cli.main([*argv, "--timeline-plot", str(tmp_path / "no" / "t.png")]) == 2
    assert "cannot write --timeline-plot" in capsys.readouterr().err
