"""Running Triton kernels on the CPU under Triton's interpreter (`TRITON_INTERPRET=1`), shared by the kernel tests.

The interpreter is chosen when Triton is imported, so each check runs in a subprocess of its own.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

needs_triton_interpreter = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or tuple(int(v) for v in np.__version__.split(".")[:2]) >= (2, 4),
    reason="needs Triton, whose 3.6 interpreter fails on numpy >= 2.4 (int() of a one-element array)")
"""Marks a test that runs kernels under the interpreter."""


def run_interpreted(script: str, timeout: float) -> None:
    """Run `script` in a Python subprocess under the interpreter; it must print only `ok`."""
    done = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
