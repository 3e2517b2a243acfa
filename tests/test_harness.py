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


def test_markdown_of_a_table_that_names_its_columns():
    table = {
        "title": "peers",
        "baseline": "a",
        "columns": [["variant", "library"], ["s", "s / iteration"], ["temp_bytes", "temp"]],
        "rows": [{"variant": "a", "s": 0.25, "temp_bytes": 2048}, {"variant": "b", "s": "not run"}],
    }
    lines = harness.markdown_table(table).splitlines()
    assert lines[2] == "| library | s / iteration | temp |"
    assert lines[4:] == ["| a | 0.25 | 2.0 KiB |", "| b | not run | - |"]


def test_ot_peers_skips_without_its_environment(tmp_path, monkeypatch, capsys):
    # `make bench` runs every script; the peers' benchmark needs its own environment.
    import ot_peers

    monkeypatch.setattr(ot_peers, "PEERS_VENV", tmp_path / "missing")
    monkeypatch.setattr(ot_peers, "PEERS", ("a_peer_that_is_not_installed",))
    ot_peers.main(quick=True)
    assert "ot_peers: skipped" in capsys.readouterr().out


def test_unknown_baseline():
    with pytest.raises(ValueError, match="baseline"):
        harness.run_table("t", [harness.Variant("a", jnp.sin, (jnp.ones(2),))], baseline="b")


def test_runner_knows_scripts():
    assert "mlp" in run.scripts()
    assert "harness" not in run.scripts() and "run" not in run.scripts()


def test_merge_memory_keeps_times_and_says_when_memory_was_remeasured(tmp_path, monkeypatch):
    # A memory-only run updates the compiled figures of matching rows; the times, the run
    # figures and rows it did not measure stay those of the timed run.
    timed = {
        "title": "t",
        "baseline": "a",
        "rows": [
            {
                "variant": "a",
                "temp_bytes": 10,
                "peak_bytes": 20,
                "time_ratio": 1.0,
                "compile_s": 1.0,
            },
            {
                "variant": "b",
                "temp_bytes": 30,
                "peak_bytes": 40,
                "time_ratio": 2.5,
                "compile_s": 1.0,
            },
        ],
    }
    fresh = {
        "title": "t",
        "baseline": "a",
        "rows": [
            {
                "variant": "a",
                "temp_bytes": 8,
                "peak_bytes": 18,
                "time_ratio": None,
                "compile_s": 9.0,
            },
        ],
    }
    results, memory_only = tmp_path / "results", tmp_path / "fresh"
    monkeypatch.setattr(harness, "RESULTS", results)
    harness.save("unit", [timed])
    monkeypatch.setattr(harness, "RESULTS", memory_only)
    harness.save("unit", [fresh])
    monkeypatch.setattr(harness, "RESULTS", results)
    changed = run.merge_memory(memory_only, "2026-12-01")
    assert changed == ["unit: a: temp_bytes 10 -> 8", "unit: a: peak_bytes 20 -> 18"]
    merged = json.loads((results / "unit.json").read_text())
    a, b = merged["tables"][0]["rows"]
    assert (a["temp_bytes"], a["time_ratio"], a["compile_s"]) == (8, 1.0, 1.0)
    assert (b["temp_bytes"], b["time_ratio"]) == (30, 2.5)
    monkeypatch.setattr(run, "scripts", lambda: ["unit"])
    page = run.markdown()
    assert "Compiled memory re-measured 2026-12-01 (same versions, nothing run)" in page
    assert "Re-checked" not in page and "Since then" not in page
