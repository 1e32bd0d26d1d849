"""`torch.compile` of the trainer's plain tensor functions, with the token dimension dynamic.

The trainer compiles functions of tensors, never modules: a module's identity and attributes
(its `layer_idx`) are guarded on, so one compiled block would recompile for every layer, while
a function of (activations, weights) compiles once and then serves every block of every model
with those shapes, for the whole process. Marking the token dimension dynamic on the first call
makes that one graph serve every row length too (rows shorter than `seq_len`, other `seq_len`s).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from tandem.models.eager_rounding import compile_like_eager

BACKEND = "inductor"
"""The `torch.compile` backend (the tests use `aot_eager`: the same tracing, no code generation)."""


@functools.cache
def compiled(fn: Callable) -> Callable:
    """`fn` compiled as one graph (a graph break is an error, not a silent slowdown), rounding like eager mode
    as the engine does (`tandem.models.eager_rounding`)."""
    return compile_like_eager(fn, backend=BACKEND, fullgraph=True)


def mark_dynamic(dim: int, *tensors: torch.Tensor | None) -> None:
    """Let dimension `dim` of each tensor vary between calls without a recompile."""
    for t in tensors:
        if t is not None:
            torch._dynamo.maybe_mark_dynamic(t, dim)
