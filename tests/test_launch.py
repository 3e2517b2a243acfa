"""Tests for memwise.launch: one program as 2 processes of 2 devices and as 4 processes of
1 device on 127.0.0.1 (jax.distributed, gloo CPU collectives), against the same program
in one process."""

import re
import subprocess
import sys
import textwrap

import pytest

MULTI_HOST_PROGRAM = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import memwise as mw
    from memwise import ot
    from beside import RTOL  # a module next to the script, found as `python script.py` would

    me = jax.process_index()
    procs = jax.process_count()
    assert procs in (2, 4) and len(jax.devices()) == 4, jax.devices()
    mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    x = jax.random.normal(jax.random.PRNGKey(0), (32, 3))
    y = jax.random.normal(jax.random.PRNGKey(1), (24, 3)) + 1.0
    q = jax.random.normal(jax.random.PRNGKey(2), (2, 32, 4))


    def global_array(a, dim=0):
        # Each process feeds only its own share of the rows, as on a cluster.
        share = a.shape[dim] // procs
        mine = jax.lax.slice_in_dim(a, me * share, (me + 1) * share, axis=dim)
        spec = P(*([None] * dim), "d")
        return jax.make_array_from_process_local_data(NamedSharding(mesh, spec), np.asarray(mine))


    def gather(a):
        return np.asarray(jax.jit(lambda a: a, out_shardings=NamedSharding(mesh, P()))(a))


    def check(name, f, args, global_args, n_diff=None):
        # The same function, sharded over both processes vs in this process alone.
        argnums = tuple(range(len(args) if n_diff is None else n_diff))
        value, grads = jax.jit(jax.value_and_grad(f, argnums))(*global_args)
        ref_value, ref_grads = jax.jit(jax.value_and_grad(f, argnums))(*args)
        np.testing.assert_allclose(gather(value), ref_value, rtol=RTOL, err_msg=name)
        for g, r in zip(grads, ref_grads):
            np.testing.assert_allclose(gather(g), r, rtol=1e-5, atol=1e-6, err_msg=name)


    A = jnp.asarray(0.5)
    check("pairwise_reduce",
          lambda x, y: jnp.sum(jnp.sin(mw.pairwise_reduce(
              lambda a, b: -A * jnp.sum((a - b) ** 2), x, y, reduce="logsumexp",
              chunk_size=(3, 4)))),
          (x, y), (global_array(x), global_array(y)))
    check("attention (ring, causal)",
          lambda q, k: jnp.sum(jnp.sin(mw.attention(q, k, k, causal=True, chunk_size=(4, 4)))),
          (q, q), (global_array(q, 1), global_array(q, 1)))
    # masks and biases on the ring (split like the queries), and jax.nn's layout with
    # 2:1 grouped K/V, segment ids, key padding and a causal mask (a ring at 4 devices);
    # in float64, where the two summation orders agree to rounding far below 1e-5
    with jax.enable_x64(True):
        f64 = lambda seed, shape: jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float64)
        qd = f64(2, (2, 32, 4))
        mask = jax.random.bernoulli(jax.random.PRNGKey(3), 0.8, (2, 32, 32))
        bias = f64(4, (2, 32, 32))
        check("attention (ring, mask and bias)",
              lambda q, k, b, m: jnp.sum(jnp.sin(mw.attention(
                  q, k, k, mask=m, bias=b, chunk_size=(4, 4)))),
              (qd, qd, bias, mask),
              (global_array(qd, 1), global_array(qd, 1), global_array(bias, 1),
               global_array(mask, 1)),
              n_diff=3)
        qh, kh = f64(5, (2, 32, 4, 8)), f64(6, (2, 32, 2, 8))
        segments = jnp.asarray([[0] * 10 + [1] * 14 + [2] * 8, [0] * 20 + [1] * 12], jnp.int32)
        lengths = jnp.asarray([30, 32], jnp.int32)
        check("dot_product_attention (ring, grouped, segments, padding, causal)",
              lambda q, k, v, s: jnp.sum(jnp.sin(mw.dot_product_attention(
                  q, k, v, is_causal=True, q_segment_ids=s, kv_segment_ids=s,
                  key_value_seq_lengths=lengths, chunk_size=(4, 4)))),
              (qh, kh, kh, segments),
              (global_array(qh, 1), global_array(kh, 1), global_array(kh, 1),
               global_array(segments, 1)),
              n_diff=3)
    check("sinkhorn_divergence",
          lambda x, y: ot.sinkhorn_divergence(x, y, epsilon=0.5, chunk_size=4, threshold=1e-6),
          (x, y), (global_array(x), global_array(y)))
    w = jnp.full(3, 0.1)
    lf = lambda w, b: jnp.mean(jnp.tanh(b @ w) ** 2)
    loss, grad = jax.jit(lambda w, b: mw.accumulate_grad(lf, w, b, microbatches=2))(w, global_array(x))
    ref_loss, ref_grad = jax.value_and_grad(lf)(w, x)
    np.testing.assert_allclose(gather(loss), ref_loss, rtol=1e-5)
    np.testing.assert_allclose(gather(grad), ref_grad, rtol=1e-5, atol=1e-7)
    # one write per line: the processes share the launcher's stdout, and print("OK", me)
    # wrote its pieces separately ("OKOK 3\\n 2" in one run)
    import sys
    sys.stdout.write(f"OK {me}\\n")
    sys.stdout.flush()
    """
)


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
def test_processes_match_one(tmp_path, processes, devices):
    # Each process feeds its own rows (make_array_from_process_local_data); no mesh=
    # anywhere: pairwise_reduce and attention (rings, with masks, biases and segment
    # ids), sinkhorn_divergence and accumulate_grad, values and gradients equal to one
    # process's to 1e-5.
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
    program = "import time\ntime.sleep(600)\n"
    proc = launch(
        tmp_path, program, "-n", "2", "--cpu-devices", "1", "--timeout", "20", timeout=120
    )
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
