"""CUDA graphs of decode-only steps, one per batch size of a fixed ladder and context bound; and, for speculative
decoding, of steps that verify drafts (k + 1 tokens a sequence: `model_runner.py`).

Why: a decode step of a small model is a thousand-odd short kernels; launched from Python each
costs more host time than the GPU spends on it. A graph replays them all with one launch. The
graphs are captured largest first into one memory pool (they never run at once), reading
static input buffers; a step of B decodes replays the smallest captured size >= B, its rows
past B padded (context 0, writes to the cache's pad slot). Prefill and mixed steps run eager.

The decode attention's grid has a program per chunk of the longest context it may meet
(`tandem/kernels/attention.py`), fixed at capture: so each batch size has a graph per context bound
(`tandem.kernels.attention.decode_context_bounds`), and a step replays the smallest bound that holds its
longest context. Short contexts then launch no idle chunk programs; the outputs are the same
under every bound (the kernel's chunks depend only on each sequence's own context).

With cascade attention (`cascade.py`) each batch size of two rows or more and bound has a second graph, whose
attention reads each group's shared prefix once; a step replays it when its plan pays.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to and including `max_batch`."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sizes + [max_batch]


def padded_batch_size(sizes: list[int], batch: int) -> int:
    """The smallest of the (sorted) `sizes` that holds `batch` rows (or tokens of context)."""
    return sizes[bisect.bisect_left(sizes, batch)]


class DecodeGraphs:
    def __init__(self, forward: Callable[[int, int, bool], torch.Tensor], max_batch: int, context_bounds: list[int],
                 cascade: bool = False):
        """`forward(b, bound, cascade)`: the step of b sequences over the static buffers, no context over `bound`,
        returning its output (a decode step's logits [b, V]; a verifying step's hidden states, a row per token);
        `cascade`: its attention reads the groups of the static plan. `context_bounds`: ascending, the last one the
        longest context allowed. `cascade`: capture those too."""
        self.sizes = graph_batch_sizes(max_batch)
        self.context_bounds = context_bounds
        self.graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = None
        for size in reversed(self.sizes):
            for bound in reversed(context_bounds):
                for variant in (False, True) if cascade and size > 1 else (False,):
                    forward(size, bound, variant)  # warmup: Triton compiles, the allocator settles, outside the capture
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        out = forward(size, bound, variant)
                    pool = graph.pool()
                    self.graphs[size, bound, variant] = (graph, out)
        torch.cuda.synchronize()

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def padded(self, batch: int) -> int:
        return padded_batch_size(self.sizes, batch)

    def replay(self, batch: int, max_context: int, cascade: bool = False, num_rows: int | None = None) -> torch.Tensor:
        """Run the graph of `padded(batch)` sequences and the smallest bound >= `max_context` (static inputs
        already filled), its cascade variant if `cascade`; the first `num_rows` rows of its output (default
        `batch`: one row a sequence)."""
        graph, out = self.graphs[self.padded(batch), padded_batch_size(self.context_bounds, max_context), cascade]
        graph.replay()
        return out[:batch if num_rows is None else num_rows]
