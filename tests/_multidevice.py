"""Run a test body in a subprocess that sees 4 CPU devices.

XLA fixes the device count when the backend starts, so tests that need a mesh run their
code in a fresh interpreter with ``XLA_FLAGS=--xla_force_host_platform_device_count=4``.
Other test modules may import :func:`run_on_devices`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

N_DEVICES = 4


# XLA:CPU's message when a collective's rendezvous of the virtual devices gave up.
STUCK = "Termination timeout for"


def run_on_devices(code: str, *, n_devices: int = N_DEVICES, timeout: float = 300) -> str:
    """Execute ``code`` with ``n_devices`` host devices; return stdout, fail on error.

    A run that XLA:CPU ends because a collective's rendezvous timed out is run once more.
    Twice under ``pytest -n 2`` (in about ten runs of the 4-device ring test), one device
    thread sat in the loss's all-reduce while the other three waited for it in a ring
    step's collective-permute; 14 runs of the same program two at a time, and 3,000
    executions of its compiled gradient, never stuck. XLA:CPU runs independent parts of
    a program concurrently, and the loss's all-reduce depends on the forward only. A
    second stuck run fails the test.
    """
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n_devices}"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if proc.returncode == 0 or STUCK not in proc.stderr:
            break
    if proc.returncode != 0:
        raise AssertionError(
            f"subprocess with {n_devices} devices failed:\n{proc.stdout}\n{proc.stderr[-6000:]}"
        )
    return proc.stdout


def run_sections_on_devices(
    sections: dict[str, str], *, n_devices: int = N_DEVICES, timeout: float = 900
) -> dict[str, str]:
    """Run several test bodies in one subprocess (one JAX start-up for all of them), in
    order, each in its own function scope; return each body's stdout by its name. A body
    that changes global configuration (``jax_enable_x64``) goes last."""
    code = []
    for name, body in sections.items():
        code.append(f"print({'@@ ' + name!r}, flush=True)")
        code.append(
            "def _section():\n" + textwrap.indent(textwrap.dedent(body), "    ") + "\n_section()\n"
        )
    out = run_on_devices("\n".join(code), n_devices=n_devices, timeout=timeout)
    parts: dict[str, str] = {}
    name = None
    for line in out.splitlines():
        if line.startswith("@@ "):
            name = line[3:]
            parts[name] = ""
        elif name is not None:
            parts[name] += line + "\n"
    missing = set(sections) - set(parts)
    assert not missing, (missing, out)
    return parts
