"""`torch.compile` that rounds where eager PyTorch rounds, for every process that compiles model functions.

Why: inductor fuses a chain of bf16 operations and by default keeps the intermediates in fp32, skipping the
rounding eager mode does after each operation. The trainer's compiled blocks would then compute other logprobs
than the engine, whose kernels round where eager mode does (`kernels/pointwise.py`), and the mismatch KL of a
bf16 model grows many times over (`benchmarks/results/rl-tandem-h200-2026-12-04.json` compiled without this,
`benchmarks/results/rl-tandem-h200-2026-12-04-same-warmup.json` with it; the preflight probe's figures
compiled, eager and with this are in `benchmarks/RESULTS.md`). With inductor's `emulate_precision_casts` every
rounding is kept, and the mismatch is eager mode's. The model's `rms_norm` compiled this way equals eager bit
for bit (`tests/models/test_eager_rounding.py`; without the option only some of its elements do).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

EAGER_ROUNDING = {"emulate_precision_casts": True}
"""Inductor's options that keep eager mode's roundings of low-precision intermediates."""


def compile_like_eager(fn: Callable, backend: str = "inductor", **kwargs: Any) -> Callable:
    """`torch.compile(fn, backend=backend, **kwargs)`, rounding like eager mode where the backend is inductor
    (other backends, such as the tests' `aot_eager`, run eager kernels and take no inductor options)."""
    return torch.compile(fn, backend=backend, options=EAGER_ROUNDING if backend == "inductor" else None, **kwargs)
