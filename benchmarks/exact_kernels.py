"""Exact mode's batch-invariant kernels alone on the GPU (`tandem.kernels.batch_invariant`), against torch's.

    python benchmarks/exact_kernels.py --out $OUT/exact-kernels.json     # CUDA, under a minute

Figures, bf16, at Qwen3-0.6B's shapes: microseconds per call of every linear of a block and of the LM head at
M rows (1 and 16: small decode batches; 256 and 512: the decode batches of workloads A and B; 4096: a prefill
step), for the engine's tile setting, a few others, and `F.linear` (cuBLAS), with the ratios; each other
setting is checked batch-invariant at M (a row alone equals the row at the batch's end). RMS norm and
log_softmax likewise against torch's. A setting worth adopting is faster at the decode batches without
losing much at prefill; it changes the numbers of exact mode (not their parity), so engine and trainer
must change together (they share the constant).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from decode_attention import time_call
from provenance import environment
from tandem.kernels import batch_invariant
from tandem.kernels.batch_invariant import LINEAR_LAUNCH, _linear_forward

LINEARS = {"q": (1024, 2048), "k_v": (1024, 1024), "o": (2048, 1024), "gate_up": (1024, 3072), "down": (3072, 1024),
           "head": (1024, 151_936)}
"""Name: (in features K, out features N) of Qwen3-0.6B's linears."""

ROWS = [1, 16, 256, 512, 4096]

SETTINGS = {
    "engine": LINEAR_LAUNCH,
    "m64n128_w4": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4),
    "m128n128_w8": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
    "m64n64_k128_w4": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3),
    "m32n64_w4": dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4),
}


def bench_linears(repeats: int, device: torch.device) -> dict:
    figures: dict = {}
    for name, (K, N) in LINEARS.items():
        weight = torch.randn(N, K, device=device, dtype=torch.bfloat16) / K ** 0.5
        for M in ROWS:
            x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
            case = {"cublas_us": time_call(lambda: F.linear(x, weight), repeats) * 1e6}
            for setting, launch in SETTINGS.items():
                try:
                    seconds = time_call(lambda: _linear_forward(x, weight, None, launch), repeats)
                    alone = _linear_forward(x[-1:], weight, None, launch)[0]
                    invariant = torch.equal(alone, _linear_forward(x, weight, None, launch)[-1])
                    case[setting] = {"us": seconds * 1e6, "over_cublas": seconds * 1e6 / case["cublas_us"],
                                     "tflops": 2 * M * N * K / seconds / 1e12, "batch_invariant": invariant}
                except Exception as e:  # a setting the GPU cannot compile (shared memory) is recorded, not fatal
                    case[setting] = {"error": f"{type(e).__name__}: {e}"[:300]}
            figures[f"{name}_M{M}"] = case
            shown = {k: round(v["us"], 1) if isinstance(v, dict) and "us" in v else v for k, v in case.items()}
            print(name, M, shown, flush=True)
    return figures


def bench_rows(repeats: int, device: torch.device) -> dict:
    """RMS norm (hidden 1024) and log_softmax (vocabulary 151,936) at decode and prefill row counts."""
    figures: dict = {}
    weight = torch.randn(1024, device=device, dtype=torch.bfloat16)
    for M in (256, 4096):
        x = torch.randn(M, 1024, device=device, dtype=torch.bfloat16)
        figures[f"rms_norm_M{M}"] = {
            "kernel_us": time_call(lambda: batch_invariant.rms_norm(x, weight, 1e-6), repeats) * 1e6,
            "torch_eager_us": time_call(lambda: weight * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6))
                                        .to(x.dtype), repeats) * 1e6}
    for M in (256, 512):
        logits = torch.randn(M, 151_936, device=device)
        temperatures = torch.ones(M, device=device)
        figures[f"log_softmax_M{M}"] = {
            "kernel_us": time_call(lambda: batch_invariant.log_softmax(logits, temperatures), repeats) * 1e6,
            "torch_us": time_call(lambda: (logits / temperatures[:, None]).log_softmax(-1), repeats) * 1e6}
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", help="write the figures to this JSON file")
    args = parser.parse_args()
    device = torch.device("cuda")
    if not batch_invariant.is_available(device):
        raise SystemExit("needs CUDA and Triton")
    results = {"environment": environment(device), "linear_settings": SETTINGS, "linears": bench_linears(args.repeats, device),
               "rows": bench_rows(args.repeats, device)}
    text = json.dumps(results, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text[-3000:])


if __name__ == "__main__":
    main()
