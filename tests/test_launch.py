"""Tests for memwise.launch: one program as 2 processes of 2 devices and as 4 processes of
1 device on 127.0.0.1 (jax.distributed, gloo CPU collectives), against the same program
in one process."""

import re
import shutil
import subprocess
import sys
import textwrap

import _launch_cases
import numpy as np
import pytest

MULTI_HOST_PROGRAM = textwrap.dedent(
    """
    import pathlib
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import memwise as mw
    from beside import RTOL  # a module next to the script, found as `python script.py` would
    from launch_cases import CASES, microbatch_loss  # tests/_launch_cases.py, copied

    me = jax.process_index()
    procs = jax.process_count()
    assert procs in (2, 4) and len(jax.devices()) == 4, jax.devices()
    mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    # the inputs and each case's value and gradients in one process (the test's)
    data = dict(np.load(pathlib.Path(__file__).with_name("cases.npz")))


    def global_array(a, dim=0):
        # Each process feeds only its own share of the rows, as on a cluster.
        share = a.shape[dim] // procs
        mine = jax.lax.slice_in_dim(a, me * share, (me + 1) * share, axis=dim)
        spec = P(*([None] * dim), "d")
        return jax.make_array_from_process_local_data(NamedSharding(mesh, spec), np.asarray(mine))


    def gather(a):
        return np.asarray(jax.jit(lambda a: a, out_shardings=NamedSharding(mesh, P()))(a))


    for case in CASES:
        # The same function, sharded over the processes vs in one process alone.
        with jax.enable_x64(case.x64):
            global_args = [global_array(data[n], d) for n, d in zip(case.args, case.split)]
            step = jax.jit(jax.value_and_grad(case.loss(data), tuple(range(case.n_diff))))
            value, grads = step(*global_args)
            ref = lambda what: data[f"{case.name}/{what}"]
            np.testing.assert_allclose(gather(value), ref("value"), rtol=RTOL, err_msg=case.name)
            assert len(grads) == case.n_diff
            for i, g in enumerate(grads):
                np.testing.assert_allclose(
                    gather(g), ref(f"grad{i}"), rtol=1e-5, atol=1e-6, err_msg=case.name
                )
    step = jax.jit(lambda w, b: mw.accumulate_grad(microbatch_loss, w, b, microbatches=2))
    loss, grad = step(data["w"], global_array(data["x"]))
    np.testing.assert_allclose(gather(loss), data["accumulate/value"], rtol=1e-5)
    np.testing.assert_allclose(gather(grad), data["accumulate/grad"], rtol=1e-5, atol=1e-7)
    # one write per line: the processes share the launcher's stdout, and print("OK", me)
    # wrote its pieces separately ("OKOK 3\\n 2" in one run)
    import sys
    sys.stdout.write(f"OK {me}\\n")
    sys.stdout.flush()
    """
)


@pytest.fixture(scope="module")
def cases():
    """The inputs and every case's value and gradients, computed once in this process
    for both launches."""
    data = _launch_cases.inputs()
    return data | _launch_cases.references(data)


def launch(tmp_path, program, *args, timeout=300):
    script = tmp_path / "program.py"
    script.write_text(program)
    (tmp_path / "beside.py").write_text("RTOL = 1e-5\n")
    return subprocess.run(
        [sys.executable, "-m", "memwise.launch", *args, str(script)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize("processes, devices", [(2, 2), (4, 1)])
@pytest.mark.slow
def test_processes_match_one(tmp_path, processes, devices, cases):
    # Each process feeds its own rows (make_array_from_process_local_data); no mesh=
    # anywhere: pairwise_reduce and attention (rings, with masks, biases and segment
    # ids), sinkhorn_divergence and accumulate_grad, values and gradients equal to one
    # process's to 1e-5.
    shutil.copy(_launch_cases.__file__, tmp_path / "launch_cases.py")
    np.savez(tmp_path / "cases.npz", **cases)
    proc = launch(
        tmp_path,
        MULTI_HOST_PROGRAM,
        *("-n", str(processes), "--cpu-devices", str(devices), "--timeout", "240"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-6000:]
    # (an OK line may follow another process's unfinished log line: Gloo's are written
    # in pieces)
    done = set(re.findall(r"OK (\d+)$", proc.stdout, re.M))
    assert done == {str(i) for i in range(processes)}, proc.stdout


@pytest.mark.slow
def test_a_failing_process_stops_the_others(tmp_path):
    # Process 1 fails at once; process 0 would wait forever: the launcher stops it and
    # returns the failure's status, well before its own timeout.
    program = textwrap.dedent(
        """
        import sys, time, jax
        if jax.process_index() == 1:
            sys.exit(3)
        time.sleep(600)
        """
    )
    proc = launch(
        tmp_path, program, "-n", "2", "--cpu-devices", "1", "--timeout", "120", timeout=150
    )
    assert proc.returncode == 3, proc.stderr[-3000:]


@pytest.mark.slow
def test_timeout_stops_every_process(tmp_path):
    # (8 s: the launcher stops the processes wherever they are, starting or sleeping;
    # the test waited out 20)
    program = "import time\ntime.sleep(600)\n"
    proc = launch(tmp_path, program, "-n", "2", "--cpu-devices", "1", "--timeout", "8", timeout=120)
    assert proc.returncode == 124
    assert "timed out" in proc.stderr


def test_bad_arguments_are_one_line_errors(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "memwise.launch", "-n", "2", str(tmp_path / "missing.py")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "no such script" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "option, words",
    [
        (["--port", "99999"], "--port 99999 is not a TCP port; pass one in 1-65535"),
        (["--port", "0"], "--port 0 is not a TCP port"),
        (["--timeout", "-3"], "--timeout -3 must be a positive number of seconds"),
        (["--timeout", "nan"], "--timeout nan must be a positive number"),
        (["--init-timeout", "0"], "--init-timeout 0 must be >= 1"),
    ],
)
def test_out_of_range_options_are_refused_before_any_process_starts(
    tmp_path, capsys, option, words
):
    from memwise.launch import main

    script = tmp_path / "never_run.py"
    script.write_text("raise SystemExit(7)\n")
    with pytest.raises(SystemExit) as info:
        main(["-n", "2", *option, str(script)])
    # A usage error exits with 2, as argparse's own do (it exited with 1).
    assert info.value.code == 2
    assert words in capsys.readouterr().err
