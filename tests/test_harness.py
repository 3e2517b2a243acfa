"""The benchmark harness measures, interleaves, saves and renders; it is not a benchmark."""

import json
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import harness  # noqa: E402
import run  # noqa: E402


def test_run_table_save_and_markdown(tmp_path, monkeypatch):
    x = jnp.ones((64, 64))
    variants = [
        harness.Variant("small", lambda a: a @ a, (x,), extra={"evaluations": 3}),
        harness.Variant("big", lambda a: jnp.outer(a, a), (x,), run=False),
    ]
    table = harness.run_table("demo", variants, baseline="small", quick=True)
    small, big = table["rows"]
    assert small["time_s"] > 0 and small["time_ratio"] == pytest.approx(1.0)
    assert big["time_s"] is None  # compiled only
    assert big["output_bytes"] == 64 * 64 * 64 * 64 * 4  # the outer product
    assert small["evaluations"] == 3

    monkeypatch.setattr(harness, "RESULTS", tmp_path)
    path = harness.save("unit", [table], notes="a note")
    saved = json.loads(path.read_text())
    assert saved["machine"]["versions"]["jax"]
    text = harness.markdown_table(saved["tables"][0])
    assert "| small |" in text and "1.00x" in text and "evaluations" in text


def test_unknown_baseline():
    with pytest.raises(ValueError, match="baseline"):
        harness.run_table("t", [harness.Variant("a", jnp.sin, (jnp.ones(2),))], baseline="b")


def test_runner_knows_scripts():
    assert "mlp" in run.scripts()
    assert "harness" not in run.scripts() and "run" not in run.scripts()
