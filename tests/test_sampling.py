"""The suite's own sampling (tests/_grid.py): what `make test` runs of the grids and of
the slow tier."""

import _grid


def test_slow_sample_takes_a_share_of_each_file_on_average(monkeypatch):
    monkeypatch.setenv("MEMWISE_TEST_SEED", "7")
    names = [f"t{i}" for i in range(10)]
    chosen = _grid.sample_slow(names, "tests/test_a.py", 0.3)
    assert len(chosen) == 3 and chosen == sorted(set(chosen))
    assert _grid.sample_slow(names, "tests/test_a.py", 0.3) == chosen  # the seed repeats it
    assert _grid.sample_slow([], "tests/test_a.py") == []
    # 0.3 of 2 tests: none, or one with probability 0.6; one at least for a file with no
    # other test
    counts = []
    for s in range(400):
        monkeypatch.setenv("MEMWISE_TEST_SEED", str(s))
        counts.append(len(_grid.sample_slow(names[:2], "tests/test_a.py", 0.3)))
        assert len(_grid.sample_slow(names[:2], "tests/test_a.py", 0.3, at_least_one=True)) == 1
    assert set(counts) == {0, 1} and 0.5 < sum(counts) / len(counts) < 0.7


def test_every_slow_test_is_chosen_by_some_seed(monkeypatch):
    names = [f"t{i}" for i in range(10)]
    seen = set()
    for s in range(40):
        monkeypatch.setenv("MEMWISE_TEST_SEED", str(s))
        seen |= set(_grid.sample_slow(names, "tests/test_a.py", 0.3))
    assert seen == set(range(10))
    seen = set()  # a file of few slow tests, each chosen in fewer runs
    for s in range(100):
        monkeypatch.setenv("MEMWISE_TEST_SEED", str(s))
        seen |= set(_grid.sample_slow(names[:3], "tests/test_a.py", 0.1))
    assert seen == set(range(3))


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


def test_a_grid_sample_covers_in_few_cases(monkeypatch):
    # The cover takes the case that covers the most values not yet covered: for a
    # 4 x 4 x 2 product, four cases, whatever the seed (taking cases in the seed's order
    # while any value is new took 5-8 of them in 20 seeds).
    monkeypatch.setenv("MEMWISE_TEST_GRID", "sample")
    for seed in range(20):
        monkeypatch.setenv("MEMWISE_TEST_SEED", str(seed))
        cases = _grid.sample_product("k", 0.0, a=range(4), b=range(4), c=[True, False])
        assert len(cases) == 4, (seed, cases)
        assert {c["a"] for c in cases} == {c["b"] for c in cases} == set(range(4))
