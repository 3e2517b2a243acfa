"""The suite's own sampling (tests/_grid.py): what `make test` runs of the grids and of
the slow tier."""

import _grid


def test_slow_sample_takes_a_share_of_each_file_and_at_least_one(monkeypatch):
    monkeypatch.setenv("MEMWISE_TEST_SEED", "7")
    names = [f"t{i}" for i in range(10)]
    chosen = _grid.sample_slow(names, "tests/test_a.py", 0.3)
    assert len(chosen) == 3 and chosen == sorted(set(chosen))
    assert _grid.sample_slow(names, "tests/test_a.py", 0.3) == chosen  # the seed repeats it
    assert len(_grid.sample_slow(names[:2], "tests/test_a.py", 0.3)) == 1
    assert _grid.sample_slow([], "tests/test_a.py") == []


def test_every_slow_test_is_chosen_by_some_seed(monkeypatch):
    names = [f"t{i}" for i in range(10)]
    seen = set()
    for s in range(40):
        monkeypatch.setenv("MEMWISE_TEST_SEED", str(s))
        seen |= set(_grid.sample_slow(names, "tests/test_a.py", 0.3))
    assert seen == set(range(10))


def test_a_grid_sample_covers_every_value_of_every_parameter(monkeypatch):
    monkeypatch.setenv("MEMWISE_TEST_GRID", "sample")  # as make test-full sets "full"
    monkeypatch.setenv("MEMWISE_TEST_SEED", "3")
    cases = _grid.sample_product(
        "k",
        0.1,
        dtype=["float16", "float32", "float64"],
        transform=["jit", "vmap", "grad"],
        n=[1, 2],
    )
    for name, values in [("dtype", 3), ("transform", 3), ("n", 2)]:
        assert len({c[name] for c in cases}) == values
    assert len(cases) < 18
