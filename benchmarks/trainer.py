"""Trainer throughput on fake-data RL steps: tokens/s, MFU and peak memory.

    python benchmarks/trainer.py --preset small --seq-len 2048 --samples-per-row 4 --rows 4 --steps 5
    torchrun --nproc-per-node 8 benchmarks/trainer.py --preset qwen3-0.6b --device cuda --seq-len 8192

A model folder of the preset (random weights) is written to a temporary folder, then the real
trainer step runs (`open_session` + `train_step`: FSDP2, chunked logprobs, AIPO loss, AdamW) on
fake batches (`tandem.trainer.data.fake_batch`: each row packs `samples-per-row` samples of
`seq_len / samples-per-row` tokens, half prompt, half completion). Publishing and checkpoints
are left out: this measures the training step alone. The first `warmup` steps are not timed.

MFU = model FLOPs per second (formula in `tandem.trainer.flops`: 6 * params * tokens plus the
attention FLOPs of the causal sequences actually in the rows) / peak FLOP/s of all ranks.
Peak: 989e12 bf16 per H100/H200 on CUDA (`--peak-flops` overrides). On CPU the peak is measured:
the best fp32 matmul FLOP/s of this process (2048^3, all its threads), printed with the result.
Peak memory: max allocated CUDA memory, or the process's peak resident memory on CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from tandem.config.trainer import ActivationCheckpointConfig, AdamWConfig, ParallelConfig, RolloutDataConfig, TrainerConfig
from tandem.config.base import ModelConfig
from tandem.models.presets import PRESETS, init_model
from tandem.trainer.batch import MicroBatch
from tandem.trainer.data import fake_batch
from tandem.trainer.flops import training_flops
from tandem.trainer.loss import build_loss
from tandem.trainer.rl.train import rl_objective
from tandem.trainer.session import open_session, peak_memory_gib
from tandem.trainer.step import train_step

H100_BF16_PEAK = 989e12


def measured_cpu_peak(size: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=list(PRESETS), default="tiny")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per packed row")
    parser.add_argument("--samples-per-row", type=int, default=4, help="sequences packed in each row")
    parser.add_argument("--rows", type=int, default=4, help="rows (micro-batches) per step over all ranks")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto", help="compute dtype")
    parser.add_argument("--ac", choices=["off", "full", "every_k"], default="off", help="activation checkpointing")
    parser.add_argument("--chunk-size", type=int, default=1024, help="logprob chunk (tokens)")
    parser.add_argument("--peak-flops", type=float, default=None, help="peak FLOP/s per rank (default: see the docstring)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        # Each rank writes its own copy: the preset's weights are a function of the seed alone.
        folder = init_model(args.preset, Path(tmp) / "model", seed=0)
        config = TrainerConfig(
            model=ModelConfig(name=str(folder), dtype=args.dtype), device=args.device, seq_len=args.seq_len,
            max_steps=args.warmup + args.steps, output_dir=Path(tmp) / "run", optim=AdamWConfig(lr=1e-6),
            parallel=ParallelConfig(activation_checkpoint=ActivationCheckpointConfig(mode=args.ac)),
            data=RolloutDataConfig(fake=True, fake_rows=args.rows, fake_samples_per_row=args.samples_per_row),
            logprob_chunk_size=args.chunk_size,
        )
        session = open_session(config, "trainer")
        try:
            result = run(config, session, args)
        finally:
            session.close()
    if result is not None:
        print(json.dumps(result))
    return 0


def run(config: TrainerConfig, session, args) -> dict | None:
    dims = session.dims
    objective = rl_objective(build_loss(config.loss))
    head_params = session.model.lm.lm_head.weight.numel()
    times, flops, tokens = [], 0.0, 0
    for step in range(1, config.max_steps + 1):
        batch = fake_batch(step, dims.rank, dims.world_size, config.data, config.seq_len, session.vocab_size, config.seed)
        micro_batches = [MicroBatch.from_row(row, dims.device) for row in batch.rows]
        sync(dims.device)
        start = time.perf_counter()
        train_step(session.model, session.optimizer, session.scheduler, micro_batches, objective, batch.num_loss_tokens,
                   config.optim.max_grad_norm, dims)
        sync(dims.device)
        if step > args.warmup:
            times.append(time.perf_counter() - start)
            lengths = [config.seq_len // args.samples_per_row] * args.samples_per_row * args.rows
            flops += training_flops(session.model.blocks, head_params, session.hf_config, lengths, batch.num_loss_tokens)
            tokens += config.seq_len // args.samples_per_row * args.samples_per_row * args.rows
    if not dims.is_main:
        return None
    elapsed = sum(times)
    if args.peak_flops is not None:
        peak, peak_note = args.peak_flops * dims.world_size, "given"
    elif dims.device.type == "cuda":
        peak, peak_note = H100_BF16_PEAK * dims.world_size, "989e12 bf16 per GPU (H100/H200)"
    else:
        peak = measured_cpu_peak()
        peak_note = f"measured fp32 matmul peak of this process, {torch.get_num_threads()} threads"
    result = {
        "preset": args.preset, "device": str(dims.device), "world_size": dims.world_size, "dtype": args.dtype, "ac": args.ac,
        "seq_len": config.seq_len, "samples_per_row": args.samples_per_row, "rows_per_step": args.rows, "steps": len(times),
        "step_time_s": elapsed / len(times), "tokens_per_s": tokens / elapsed, "model_tflops_per_s": flops / elapsed / 1e12,
        "mfu": flops / elapsed / peak, "peak_tflops": peak / 1e12, "peak_note": peak_note,
        "peak_memory_gib": peak_memory_gib(dims.device),
    }
    print(f"{args.preset} on {dims.device} x{dims.world_size}, seq_len {config.seq_len} ({args.samples_per_row} samples/row, "
          f"{args.rows} rows/step): {result['tokens_per_s']:.0f} tokens/s, {result['step_time_s'] * 1e3:.0f} ms/step, "
          f"MFU {result['mfu']:.1%} of {result['peak_tflops']:.3g} TFLOP/s ({peak_note}), "
          f"peak memory {result['peak_memory_gib']:.2f} GiB", file=sys.stderr)
    return result


if __name__ == "__main__":
    sys.exit(main())
