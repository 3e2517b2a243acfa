"""The memwise command: demo, report (file and module factories), bench, errors."""

import json
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
    assert cli.main(["report", f"{user_file}:factory", "--grad", "--json", "--plot", str(plot)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["grad"] is True and data["peak_bytes"] > 0
    assert plot.exists()


def test_report_module_factory_with_kwargs(user_file, capsys, monkeypatch):
    monkeypatch.chdir(user_file.parent)
    assert cli.main(["report", "user_model:with_kwargs"]) == 0
    assert "peak" in capsys.readouterr().out


@pytest.mark.parametrize(
    "spec, message",
    [("no_colon", "MODULE:FACTORY"), ("{file}:missing", "no function"),
     ("{file}:not_a_tuple", "must return"), ("/nope/x.py:f", "no such file")],
)
def test_report_errors(user_file, spec, message):
    with pytest.raises(SystemExit, match=message):
        cli.main(["report", spec.format(file=user_file)])


def test_demo_prints_table(capsys, tmp_path):
    plot = tmp_path / "demo.png"
    assert cli.main(["demo", "mlp", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "naive peak" in out and "memwise peak" in out
    row = next(line for line in out.splitlines() if line.startswith("mlp "))
    assert " yes " in row
    assert plot.exists()


def test_demo_unknown_scenario():
    with pytest.raises(SystemExit, match="unknown scenario"):
        cli.main(["demo", "nope"])


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


def test_python_dash_m_and_console_script(user_file):
    for command in ([sys.executable, "-m", "memwise"], [str(Path(sys.executable).parent / "memwise")]):
        result = subprocess.run([*command, "report", f"{user_file}:factory"],
                                capture_output=True, text=True, timeout=120)
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
