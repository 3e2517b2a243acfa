"""Run one JAX program as N processes on this machine, joined by ``jax.distributed``.

``python -m memwise.launch -n 2 --cpu-devices 2 script.py [args]`` starts 2 processes
that each call ``jax.distributed.initialize`` with a coordinator on 127.0.0.1 (gloo
collectives on CPU, ``--cpu-devices`` host devices each) and then run ``script.py`` as
``__main__``. The script is the one a cluster would run: ``jax.devices()`` lists every
process's devices, a mesh spans them, and each process feeds its own rows with
``jax.make_array_from_process_local_data``. It is how memwise's multi-host code is
tested without a cluster (JAX's multi-controller model: one program, one process per
host); on a real cluster use its launcher (Slurm, ``mpirun``) and call
``jax.distributed.initialize()`` in the script instead.

The launcher waits for every process, and when one fails or ``--timeout`` passes it
stops the others, so no process outlives it. Its exit status is the first failure's
(124 on a timeout), else 0.
"""

from __future__ import annotations

import argparse
import os
import runpy
import socket
import subprocess
import sys
import time
import traceback

__all__ = ["main"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m memwise.launch",
        description="Run a JAX script as N processes on this machine (jax.distributed "
        "over 127.0.0.1).",
    )
    p.add_argument("-n", "--processes", type=int, required=True, help="number of processes")
    p.add_argument(
        "--cpu-devices",
        type=int,
        default=None,
        help="host (CPU) devices per process (XLA_FLAGS); default: XLA's own",
    )
    p.add_argument("--port", type=int, default=None, help="coordinator port (default: free)")
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds before every process is stopped (exit status 124)",
    )
    p.add_argument(
        "--init-timeout",
        type=int,
        default=60,
        help="seconds each process waits for the others to join",
    )
    p.add_argument("script", help="the Python program every process runs")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    return p


def _child(
    process_id: int, n: int, address: str, init_timeout: int, script: str, args: list[str]
) -> None:
    import jax

    # Collectives between CPU processes (accelerators use their own).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=address,
        num_processes=n,
        process_id=process_id,
        initialization_timeout=init_timeout,
    )
    sys.argv = [script, *args]
    # As `python script.py` does: the script's folder first on the path, so that it
    # imports the modules beside it.
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if code:
            _exit_now(code)
    except BaseException:
        traceback.print_exc()
        _exit_now(1)
    jax.distributed.shutdown()  # waits for the other processes to finish too


def _exit_now(code: int) -> None:
    """Exit without the shutdown barrier, which would wait for the processes still
    running: the launcher sees the failure at once and stops them."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    """``python -m memwise.launch`` with ``argv`` (default ``sys.argv[1:]``): the exit status.

    Example::

        >>> import pathlib, tempfile
        >>> from memwise.launch import main
        >>> script = pathlib.Path(tempfile.mkdtemp()) / "hello.py"
        >>> _ = script.write_text("import jax\\nassert jax.process_count() == 2\\n")
        >>> main(["-n", "2", str(script)])  # both processes joined and ran the script
        0
    """
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        process_id, n, address, init_timeout, script, *args = argv[1:]
        _child(int(process_id), int(n), address, int(init_timeout), script, args)
        return 0
    parser = _parser()
    opts = parser.parse_args(argv)
    if opts.processes < 1:
        parser.error("-n/--processes must be >= 1")
    if opts.port is not None and not 1 <= opts.port <= 65535:
        parser.error(
            f"--port {opts.port} is not a TCP port; pass one in 1-65535 "
            "(or leave it out for a free one)"
        )
    if opts.timeout is not None and not opts.timeout > 0:
        parser.error(
            f"--timeout {opts.timeout:g} must be a positive number of seconds "
            "(or leave it out to wait as long as the processes run)"
        )
    if opts.init_timeout < 1:
        parser.error(f"--init-timeout {opts.init_timeout} must be >= 1 s")
    if not os.path.isfile(opts.script):
        parser.error(f"no such script: {opts.script}")
    env = dict(os.environ)
    if opts.cpu_devices is not None:
        if opts.cpu_devices < 1:
            parser.error("--cpu-devices must be >= 1")
        env["XLA_FLAGS"] = (
            env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={opts.cpu_devices}"
        ).strip()
        env.setdefault("JAX_PLATFORMS", "cpu")
    address = f"127.0.0.1:{opts.port or _free_port()}"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "memwise.launch",
                "--child",
                str(i),
                str(opts.processes),
                address,
                str(opts.init_timeout),
                opts.script,
                *opts.args,
            ],
            env=env,
        )
        for i in range(opts.processes)
    ]
    deadline = None if opts.timeout is None else time.monotonic() + opts.timeout
    status = 0
    try:
        while any([p.poll() is None for p in procs]):  # a list: poll every process
            failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
            if failed:
                status = failed[0]
                break
            if deadline is not None and time.monotonic() > deadline:
                print(f"memwise.launch: timed out after {opts.timeout} s", file=sys.stderr)
                status = 124
                break
            time.sleep(0.1)
        else:
            status = next((p.returncode for p in procs if p.returncode), 0)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    return status


if __name__ == "__main__":
    sys.exit(main())
