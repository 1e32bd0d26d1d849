"""The memory roofline of decode steps: a decode step must read the weights once and the KV cache its
batch attends to, so at the GPU's memory bandwidth it takes at least

    (weight bytes + KV bytes per token x the contexts of its sequences, summed) / bandwidth.

`benchmarks/inference.py` reports, for each decode figure, that bound and the measured step's
fraction of it (1.0 = the step runs at memory speed; attention that leaves SMs idle shows here).
The bandwidth is both the GPU's nominal one (where known) and one measured in the same run with a
large device-to-device copy (what the GPU really delivers, the fairer bound).
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

NOMINAL_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}
"""Bytes/s of HBM by GPU name (data sheet; the H100 SXM's and the A100 80GB's figures)."""


def nominal_bandwidth(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((bw for key, bw in NOMINAL_BANDWIDTH.items() if key in name), None)


def measured_copy_bandwidth(device: torch.device, num_bytes: int = 2 << 30, repeats: int = 5) -> float:
    """Bytes/s moved (read plus written) by the fastest of `repeats` copies of a `num_bytes` buffer."""
    if device.type != "cuda":
        num_bytes = min(num_bytes, 256 << 20)  # the CPU path only checks the code runs
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warmup
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - t0
        best = min(best, seconds)
    return 2 * num_bytes / best


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the parameters a decode step reads: all of them (tied ones once), with the FP8 weights and their
    scales (`engine.quantization = "fp8"` holds them as buffers), less an untied input embedding (a decode reads
    only its tokens' rows) and layers the forward never runs (GLM-5's multi-token prediction layer). For a mixture
    of experts this counts every expert."""
    unread = getattr(model.model, "mtp_layers", nn.ModuleList())
    fp8 = [b for name, b in model.named_buffers() if b.dtype == torch.float8_e4m3fn or name.endswith("_scale_inv")]
    total = (sum(p.numel() * p.element_size() for p in model.parameters()) + sum(b.nbytes for b in fp8)
             - sum(p.nbytes for p in unread.parameters()))
    embedding = model.model.embed_tokens.weight
    if embedding is not model.lm_head.weight:
        total -= embedding.numel() * embedding.element_size()
    return total


def decode_roofline(steps: list[tuple[int, int, float]], weights: int, kv_per_token: int,
                    bandwidths: dict[str, float | None]) -> dict:
    """`steps`: the decode-only steps' (sequences, contexts summed, seconds). The steps at the full batch
    (the median step, its bound) and all decode steps (their sums), per bandwidth."""
    if not steps:
        return {}
    full = max(b for b, _, _ in steps)
    at_full = [(ctx, s) for b, ctx, s in steps if b == full]
    median_s = statistics.median(s for _, s in at_full)
    median_ctx = statistics.median(ctx for ctx, _ in at_full)
    step_bytes = [weights + ctx * kv_per_token for _, ctx, _ in steps]
    figures: dict = {"weight_bytes": weights, "kv_bytes_per_token": kv_per_token, "full_batch": full,
                     "full_batch_step_median_s": median_s, "full_batch_context_tokens_median": median_ctx,
                     "full_batch_bytes_median": weights + median_ctx * kv_per_token,
                     "decode_steps": len(steps), "decode_seconds": sum(s for _, _, s in steps)}
    for name, bandwidth in bandwidths.items():
        if not bandwidth:
            continue
        bound = (weights + median_ctx * kv_per_token) / bandwidth
        figures[name] = {"bandwidth_bytes_per_s": bandwidth, "full_batch_roofline_s": bound,
                         "full_batch_fraction": bound / median_s,
                         "all_decode_roofline_s": sum(step_bytes) / bandwidth,
                         "all_decode_fraction": sum(step_bytes) / bandwidth / figures["decode_seconds"]}
    return figures
