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


def run_interpreted(script: str, timeout: float, folder: str | None = None) -> None:
    """Run `script` in a Python subprocess under the interpreter; it must print only `ok`.

    The subprocess finds tests/'s shared modules (this one, `attention_cases`) as pytest's `pythonpath` lets the
    tests find them: a test module the script imports imports them too. `folder`: a folder of test modules the
    script imports, put first on its path."""
    tests = os.path.dirname(os.path.abspath(__file__))
    python_path = os.pathsep.join(filter(None, [folder, tests, os.environ.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=python_path),
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def dots_row_by_row() -> None:
    """Make the interpreter's `tl.dot` compute each row of a tile apart, as a GPU's matrix instructions do.

    The interpreter hands a tile's product to numpy's `matmul`, whose BLAS sums a row's terms in an order that depends
    on where the row falls in its micro-kernel's block (some rows of a 64-row tile differ in their last bits from the
    same row alone). That is the interpreter's own arithmetic, not the kernel's: a kernel whose rows never mix is
    batch invariant on the GPU, and one that mixes them (a split K chosen from M, say) still fails under this."""
    from triton.runtime import interpreter

    dot = interpreter.InterpreterBuilder.create_dot

    def row_by_row(self, a, b, d, *args):
        rows = [dot(self, interpreter.TensorHandle(a.data[..., i:i + 1, :], a.dtype), b,
                    interpreter.TensorHandle(d.data[..., i:i + 1, :], d.dtype), *args) for i in range(a.data.shape[-2])]
        return interpreter.TensorHandle(np.concatenate([row.data for row in rows], axis=-2), rows[0].dtype)

    interpreter.InterpreterBuilder.create_dot = row_by_row
