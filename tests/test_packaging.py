"""The package as users get it: a wheel and an sdist that pass ``twine check``, carry the
license and ``py.typed``, and a wheel that installs into a fresh virtual environment and
runs ``memwise demo mlp`` there, away from the source tree."""

import fcntl
import importlib.metadata
import os
import subprocess
import sys
import tarfile
import venv
import zipfile
from pathlib import Path

import pytest

import memwise

ROOT = Path(__file__).resolve().parents[1]


def _run(command: list[str], *, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)


def test_version_is_single_sourced():
    assert importlib.metadata.version("memwise") == memwise.__version__
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject
    assert 'version = {attr = "memwise.__version__"}' in pyproject


def test_jax_floor_is_declared_once():
    from memwise import _jax_private

    floor = ".".join(map(str, _jax_private.MIN_JAX))
    assert f'"jax>={floor}"' in (ROOT / "pyproject.toml").read_text()


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    # Under pytest -n 2 each worker that runs a test of this module builds; setuptools
    # stages the sdist and the wheel inside the source tree, and two builds at once
    # removed each other's files. One build at a time, across processes.
    lock = ROOT / "build" / "packaging.lock"
    lock.parent.mkdir(exist_ok=True)
    with lock.open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        build = _run(
            [sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", str(out), str(ROOT)],
            timeout=600,
        )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    wheels, sdists = list(out.glob("*.whl")), list(out.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, list(out.iterdir())
    return wheels[0], sdists[0]


@pytest.mark.slow
def test_wheel_and_sdist_pass_twine_check(dist):
    check = _run([sys.executable, "-m", "twine", "check", "--strict", *map(str, dist)], timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.count("PASSED") == 2, check.stdout


@pytest.mark.slow
def test_wheel_holds_the_package_license_and_types(dist):
    wheel, sdist = dist
    assert wheel.name.startswith(f"memwise-{memwise.__version__}-")
    names = zipfile.ZipFile(wheel).namelist()
    assert "memwise/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
    assert "memwise/ntk/kernels.py" in names and "memwise/scenarios/mlp.py" in names
    assert not any(n.startswith(("tests/", "benchmarks/", "docs/")) for n in names)
    metadata = zipfile.ZipFile(wheel).read(
        next(n for n in names if n.endswith(".dist-info/METADATA"))
    )
    assert b"License-Expression: Apache-2.0" in metadata
    with tarfile.open(sdist) as tar:
        members = tar.getnames()
    assert any(m.endswith("/LICENSE") for m in members)
    assert any(m.endswith("/src/memwise/py.typed") for m in members)


@pytest.mark.slow
def test_wheel_installs_and_runs_its_demo_in_a_fresh_environment(dist, tmp_path):
    wheel, _ = dist
    env_dir = tmp_path / "env"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    install = _run([str(python), "-m", "pip", "install", "--quiet", str(wheel)], timeout=900)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    away = tmp_path / "elsewhere"
    away.mkdir()
    clean_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    where = _run(
        [str(python), "-c", "import memwise; print(memwise.__file__, memwise.__version__)"],
        cwd=away,
        env=clean_env,
        timeout=300,
    )
    assert where.returncode == 0, where.stderr
    path, version = where.stdout.split()
    assert Path(path).is_relative_to(env_dir) and version == memwise.__version__
    demo = _run(
        [str(env_dir / "bin" / "memwise"), "demo", "mlp"], cwd=away, env=clean_env, timeout=600
    )
    assert demo.returncode == 0, demo.stdout + demo.stderr
    rows = [line.split() for line in demo.stdout.splitlines() if line.startswith("mlp ")]
    assert len(rows) == 1 and "yes" in rows[0], demo.stdout  # the two programs agree
    # the development command says what to do instead of failing obscurely
    bench = _run([str(env_dir / "bin" / "memwise"), "bench"], cwd=away, env=clean_env, timeout=300)
    assert bench.returncode == 2 and "python -m benchmarks" in bench.stderr, bench.stderr
