"""`torch.compile` that rounds where eager PyTorch rounds, for every process that compiles model functions.

Why: inductor fuses a chain of bf16 operations and by default keeps the intermediates in fp32, skipping the
rounding eager mode does after each operation. The trainer's compiled blocks then computed other logprobs
than the engine, whose kernels round where eager mode does (`kernels/pointwise.py`): on the
reverse-text model in bf16 the preflight's probe (2,208 tokens, CPU) measured a mismatch KL of 7.6e-4 with the
trainer compiled against 1.0e-5 eager, and the H200 run of that example 7.6e-4 on its probe. With inductor's
`emulate_precision_casts` every rounding is kept: 9.8e-6. The model's `rms_norm` compiled this way equals
eager bit for bit (`tests/models/test_compiling.py`; without the option 75% of its elements did).
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
