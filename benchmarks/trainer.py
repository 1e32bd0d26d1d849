"""Trainer throughput on fake-data RL steps: tokens/s, MFU and peak memory, against a plain baseline.

    python benchmarks/trainer.py --preset small --device cpu --shapes 2048:4:4
    python benchmarks/trainer.py --preset qwen3-0.6b --device cuda --shapes 16384:1:2 16384:8:2 65536:1:1 \\
        --baseline 16384:1:2 --out benchmarks/results/trainer-h200-DATE.json
    torchrun --nproc-per-node 4 benchmarks/trainer.py --preset qwen3-0.6b --shapes 16384:1:8 \\
        --out benchmarks/results/trainer-h200x4-DATE.json      # FSDP2 over 4 GPUs, 2 rows a rank
    python benchmarks/trainer.py --preset qwen3-30b-a3b --num-layers 8 --device cuda --shapes 16384:1:1 \\
        --baseline 16384:1:1 --out benchmarks/results/trainer-moe-h200-DATE.json   # MoE, cut to 8 blocks
    torchrun --nproc-per-node 4 benchmarks/trainer.py --preset qwen3-30b-a3b --num-layers 8 --ep 4 --shapes 16384:1:4
    python benchmarks/trainer.py --preset qwen3-0.6b --device cuda --shapes 16384:1:1 --fp8 off tensorwise rowwise \
        --out benchmarks/results/trainer-fp8-h100-DATE.json     # bf16 and both FP8 recipes in one run, their ratios
    python benchmarks/trainer.py --preset qwen3-0.6b --device cuda --max-position-embeddings 262144 \
        --shapes 65536:1:1 131072:1:1 262144:1:1 --ac selective --chunk-size 1024 --steps 2 --warmup 1 \
        --out benchmarks/results/trainer-long-h200-DATE.json     # one long sequence per step, YaRN positions
    torchrun --nproc-per-node 2 benchmarks/trainer.py --preset qwen3-0.6b --max-position-embeddings 262144 --cp 2 \
        --shapes 131072:1:2                                     # context parallel: each 128k row over 2 GPUs

A shape `SEQ_LEN:SAMPLES:ROWS` is a step of ROWS rows of SEQ_LEN tokens, each row packing SAMPLES
sequences of SEQ_LEN / SAMPLES tokens, half prompt and half completion
(`tandem.trainer.data.fake_batch`). ROWS counts the rows of the whole step: under torchrun each
rank trains ROWS / world size of them, so one shape is the same global batch (and the same loss
trajectory) at every world size; tokens/s is over all ranks, MFU per GPU (the step's FLOPs over
world size x peak), peak memory rank 0's. Under torchrun give one shape per launch and no
baseline (the process group lives as long as one run). No weights touch the disk: a folder of the
preset's config.json and tokenizer is written to a temporary folder, and both runs make the same
random weights on the device, each tensor drawn from its name (`tandem.models.random_init`:
tandem's `model.load_format = "dummy"`), so every run of a shape trains the same model on the
same rows and the first steps of tandem and the baseline agree.

- `tandem`: the real trainer step (`open_session` + `train_step`: FSDP2, the trainer's block
  forward, document attention, fused chunked logprobs, AIPO, AdamW) with the config's defaults
  unless a flag says otherwise; the result names the options used (compilation, activation
  checkpointing mode, logprob chunk size, SDPA backends). A run that fails while compiled is run
  again with `kernels.compile = off` and both results are kept.
- `baseline` (`--baseline`, rows of one sequence only): transformers' own model class of the
  preset (Qwen3ForCausalLM, Qwen3MoeForCausalLM) built from the same config.json on the device,
  with tandem's random weights (by name: transformers 5's in-memory names are tandem's), its
  default experts implementation (grouped GEMM where it can dispatch it),
  SDPA attention (at torch's default kernel order) and gradient checkpointing,
  fp32 master weights under bf16 autocast (fp32 everywhere on a CPU), full fp32 logits
  [tokens x vocab] and log_softmax over them, the same AIPO loss on the same rows, torch's AdamW
  (default implementation) with the same hyper-parameters and gradient clipping.

MFU = model FLOPs / step time / peak FLOP/s, the same count for both (`tandem.trainer.flops`):

    FLOPs per step = 6 * P_active * (tokens of the step) + sum over sequences of 6 * layers * Hq * D * L^2
    P_active = all parameters - sum over MoE blocks of (E - k) / E * (routed expert parameters)

P_active = the parameters each token goes through (the tied embedding once: it is the LM head's
matmul; k of the E routed experts of a MoE block; every parameter of a dense model), L = each sequence's
length: attention counts only the causal sequences actually in the rows, never across packed
samples. Latent attention and DSA (GLM-5, DeepSeek-V3) count their own heads' dims and the pairs DSA keeps,
and DSA's forward-only indexers apart (`tandem.trainer.flops`' docstring). The same per-step count for both runs
makes their MFU ratio their tokens/s ratio.
`mfu_trainer_flops` also gives tandem's MFU over the FLOPs it asks for (the LM head on loss
tokens only, `training_flops`). Recomputation is never counted.
Peak: 989e12 (dense bf16 of one H100/H200 by the datasheet) per GPU on CUDA (`--peak-flops`
overrides); on a CPU, the best fp32 2048^3 matmul rate of this process, measured here.
Peak memory: max allocated (and reserved) CUDA memory over all steps of the run, or the
process's peak resident memory on a CPU. The first `--warmup` steps (compilation) are not timed
into the figures; their times are kept (`warmup_step_times_s`: what compiling costs).

The result file keeps a per-shape `table` (tokens per step, ms/step, MFU, tokens/s, peak memory), and
each tandem run counts what its timed steps did that a steady step should not: graphs compiled by
`torch.compile` (a guard that failed) and CUDA allocations (`once_only_events_in_timed_steps`).
`--fp8 off tensorwise rowwise` runs every shape once per setting of `fp8` (`off`: bf16; a recipe: `fp8.enabled`
with it, `tandem.trainer.float8`), on the same weights and rows: `fp8_ratio_to_bf16` gives each recipe's tokens/s
over bf16's (the same FLOPs counted, so also its MFU ratio: MFU stays against the bf16 dense peak), and each run's
`losses` its per-step losses beside bf16's.
`--profile DIR` then profiles two more steps of each tandem shape (`benchmarks/step_profile.py`):
milliseconds per phase of the step with the device synchronised at each boundary, and a
`torch.profiler` step (top ops by self CUDA and CPU time, each phase's CPU and kernel time, the
fraction of the step the GPU is busy, a trace):

    python benchmarks/trainer.py --preset qwen3-0.6b --device cuda --shapes 4096:1:1 16384:1:1 --profile out/profile \
        --profile-shapes 4096:1:1
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from provenance import environment
from tandem.config.base import ModelConfig, RunConfig
from tandem.config.trainer import (ActivationCheckpointConfig, AdamWConfig, AIPOLoss, Float8TrainingConfig, KernelsConfig,
                                   ParallelConfig, RolloutDataConfig, TrainerConfig)
from tandem.models.loading import DUMMY_SEED, build_native
from tandem.models.presets import PRESETS, preset_config, write_model
from tandem.models.random_init import initial_value
from tandem.trainer.batch import prepare_micro_batches
from tandem.trainer.micro_batch import MicroBatch
from tandem.trainer.data import fake_batch
from tandem.trainer.flops import active_params, model_flops, training_flops
from tandem.trainer.loss import LossInputs, build_loss
from tandem.trainer.model import compute_dtype, should_compile
from tandem.trainer.rl.train import rl_objective
from tandem.trainer.session import open_session, peak_memory_gib
from tandem.trainer.step import StepResult, train_step

from step_profile import counts_since, once_only_counts, phase_summary, profile_shape, sync

H100_BF16_PEAK = 989e12
MFU_FORMULA = ("(6 * P_active * tokens + sum over sequences of 6 * layers * Hq * D * L^2) / step time / peak; "
               "P_active = all parameters - sum over MoE blocks of (E - k) / E * routed expert parameters; "
               "latent attention and DSA as tandem.trainer.flops counts them")


@dataclass(frozen=True)
class Shape:
    seq_len: int
    samples_per_row: int
    rows: int

    @classmethod
    def parse(cls, text: str) -> "Shape":
        try:
            seq_len, samples, rows = (int(x) for x in text.split(":"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"shape {text!r}: expected SEQ_LEN:SAMPLES:ROWS, e.g. 16384:1:2") from None
        if seq_len // samples < 2 or rows < 1:
            raise argparse.ArgumentTypeError(f"shape {text!r}: needs at least 2 tokens per sample and 1 row")
        return cls(seq_len, samples, rows)

    def __str__(self) -> str:
        return f"{self.seq_len}:{self.samples_per_row}:{self.rows}"

    @property
    def sequence_lengths(self) -> list[int]:
        return [self.seq_len // self.samples_per_row] * self.samples_per_row * self.rows


def measured_cpu_peak(size: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def reset_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def memory_figures(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30,
                "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30}
    return {"peak_memory_gib": peak_memory_gib(device)}


def timing(times: list[float], shape: Shape, flops_per_step: float, peak: float, world_size: int = 1) -> dict:
    """`peak` is one device's; the step's FLOPs spread over `world_size` of them."""
    step_time = sum(times) / len(times)
    tokens_per_s = shape.seq_len * shape.rows / step_time
    return {"steps": len(times), "step_times_s": times, "step_time_s": step_time, "world_size": world_size,
            "tokens_per_s": tokens_per_s, "tokens_per_s_per_rank": tokens_per_s / world_size,
            "model_tflops_per_s": flops_per_step / step_time / 1e12, "mfu": flops_per_step / step_time / (peak * world_size)}


def fp8_config(setting: str) -> Float8TrainingConfig:
    """`--fp8`'s `off` (bf16) or a recipe."""
    return Float8TrainingConfig() if setting == "off" else Float8TrainingConfig(enabled=True, recipe=setting)


def tandem_config(folder: Path, shape: Shape, args, kernels: KernelsConfig, run_dir: str, fp8: str = "off") -> TrainerConfig:
    """The trainer's config for one shape: the defaults, or the flags' options; `fp8`: one `--fp8` setting."""
    checkpointing = {} if args.ac is None else {"activation_checkpoint": ActivationCheckpointConfig(mode=args.ac)}
    return TrainerConfig(
        model=ModelConfig(name=str(folder), dtype=args.dtype, load_format="dummy"), device=args.device, seq_len=shape.seq_len,
        max_steps=args.warmup + args.steps, output_dir=Path(run_dir), optim=AdamWConfig(lr=1e-6),
        parallel=ParallelConfig(ep=args.ep, cp=args.cp, reshard_after_forward=args.reshard_after_forward == "on",
                                fsdp_at_one_rank=args.fsdp_at_one_rank == "on", **checkpointing),
        data=RolloutDataConfig(fake=True, fake_rows=shape.rows, fake_samples_per_row=shape.samples_per_row),
        kernels=kernels, run=RunConfig(exact=args.exact), fp8=fp8_config(fp8),
        **({} if args.chunk_size is None else {"logprob_chunk_size": args.chunk_size}),
    )


def wants_profile(args, shape: Shape) -> bool:
    return args.profile is not None and (args.profile_shapes is None or shape in args.profile_shapes)


def profile_run(args, shape: Shape, session, run, inputs) -> dict:
    """`--profile`: three more steps of `run(*inputs())` profiled into `args.profile`, and one publish of the
    weights timed (the RL loop's, after every `weights.interval` steps; not part of the timed step); the summary."""
    dims = session.dims
    label = f"tandem-{shape.seq_len}x{shape.samples_per_row}x{shape.rows}" + (f"-rank{dims.rank}" if dims.world_size > 1 else "")
    report = profile_shape(run, inputs, dims.device, args.profile, label, publish=lambda: session.publish(args.warmup + args.steps + 1))
    if dims.is_main:
        print(f"{shape} profile: {phase_summary(report)}", file=sys.stderr, flush=True)
    return {"file": f"{label}.json", **report["synchronised_phases"], "gpu_busy_fraction": report["profiler"]["gpu_busy_fraction"],
            "publish_ms": report["publish_ms"]}


def run_tandem(folder: Path, shape: Shape, args, kernels: KernelsConfig, peak: float, fp8: str = "off") -> dict:
    """The real trainer step: the config's defaults, or the flags' options; profiled after the timed steps
    with `--profile`; `fp8`: one `--fp8` setting."""
    with tempfile.TemporaryDirectory() as run_dir:
        config = tandem_config(folder, shape, args, kernels, run_dir, fp8)
        session = open_session(config, "trainer")
        try:
            dims, model = session.dims, session.model
            objective = rl_objective(build_loss(config.loss))
            num_params = active_params(model.lm)
            options = {"ep": dims.ep_size, "cp": dims.cp_size, "compile": should_compile(config.kernels, dims.device),
                       "compiled_stack": model.compiled_stack,
                       "reshard_after_forward": config.parallel.reshard_after_forward,
                       "fsdp_at_one_rank": config.parallel.fsdp_at_one_rank,
                       "activation_checkpoint": config.parallel.activation_checkpoint.mode,
                       "logprob_chunk_size": config.logprob_chunk_size, "sdpa_backends": config.kernels.sdpa_backends,
                       "compute_dtype": str(compute_dtype(config.model, dims.device)), "optimizer": "AdamW (fused on CUDA)",
                       "exact": config.run.exact, "fp8": fp8}

            def inputs(step: int) -> tuple[list[MicroBatch], int]:
                batch = fake_batch(step, dims.rank, dims.world_size, config.data, config.seq_len, session.vocab_size, config.seed)
                return prepare_micro_batches(batch.rows, dims), batch.num_loss_tokens

            def run(micro_batches: list[MicroBatch], num_loss_tokens: int) -> StepResult:
                return train_step(model, session.optimizer, session.scheduler, micro_batches, objective, num_loss_tokens,
                                  config.optim.max_grad_norm, dims)

            reset_memory(dims.device)
            times, warmup_times, losses = [], [], []
            for step in range(1, config.max_steps + 1):
                if step == args.warmup + 1:
                    counts = once_only_counts(dims.device)
                micro_batches, num_loss_tokens = inputs(step)
                sync(dims.device)
                start = time.perf_counter()
                result = run(micro_batches, num_loss_tokens)
                sync(dims.device)
                losses.append({"loss": result.loss, "grad_norm": result.grad_norm, "entropy": result.metrics["entropy"]})
                (times if step > args.warmup else warmup_times).append(time.perf_counter() - start)
            flops = model_flops(num_params, session.hf_config, shape.sequence_lengths)
            trainer_flops = training_flops(model.blocks, model.lm.lm_head.weight.numel(), session.hf_config,
                                           shape.sequence_lengths, num_loss_tokens)
            out = {"impl": "tandem", "options": options, **timing(times, shape, flops, peak, dims.world_size),
                   "mfu_trainer_flops": trainer_flops / (sum(times) / len(times)) / (peak * dims.world_size),
                   **memory_figures(dims.device), "active_params": num_params,
                   "once_only_events_in_timed_steps": counts_since(counts, dims.device),
                   "warmup_step_times_s": warmup_times, "losses": losses}
            if wants_profile(args, shape):  # after the memory figures: the profiler's own buffers are not the step's
                out["profile"] = profile_run(args, shape, session, run, lambda: inputs(config.max_steps + 1))
        finally:
            session.close()
    return out


def run_baseline(folder: Path, shape: Shape, args, peak: float) -> dict:
    """transformers' model, gradient checkpointing, full fp32 logits, torch AdamW: see the docstring."""
    from transformers import AutoConfig, AutoModelForCausalLM

    device = torch.device("cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu")
    hf_config = json.loads((folder / "config.json").read_text())
    config = AutoConfig.from_pretrained(folder)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():  # tandem's dummy weights, drawn on this device from each tensor's name
        for name, param in model.named_parameters():
            param.copy_(initial_value(name, param.shape, DUMMY_SEED, device))
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optim = AdamWConfig(lr=1e-6)
    optimizer = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay)
    loss_fn = build_loss(AIPOLoss())
    data = RolloutDataConfig(fake=True, fake_rows=shape.rows, fake_samples_per_row=shape.samples_per_row)
    vocab = model.config.vocab_size
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    reset_memory(device)
    times, losses = [], []
    for step in range(1, args.warmup + args.steps + 1):
        batch = fake_batch(step, 0, 1, data, shape.seq_len, vocab, 0)
        micro_batches = [MicroBatch.from_row(row, device) for row in batch.rows]
        sync(device)
        start = time.perf_counter()
        loss_sum = entropy_sum = torch.zeros((), device=device)
        for mb in micro_batches:
            with autocast:
                logits = model(input_ids=mb.input_ids, position_ids=mb.position_ids).logits
            logp = torch.log_softmax(logits.float() / mb.temperatures[..., None], dim=-1)
            picked = logp[:, :-1].gather(-1, mb.input_ids[:, 1:, None]).squeeze(-1)
            logprobs = torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)
            with torch.no_grad():  # entropy of the distribution token t was drawn from, as the trainer logs it
                entropy = torch.cat([torch.zeros_like(picked[:, :1]), -(logp[:, :-1].exp() * logp[:, :-1]).sum(-1)], dim=1)
            per_token = loss_fn(LossInputs(logprobs, mb.inference_logprobs, mb.advantages, mb.loss_mask)).per_token
            loss = torch.where(mb.loss_mask, per_token, 0.0).sum() / batch.num_loss_tokens
            loss.backward()
            loss_sum = loss_sum + loss.detach()
            entropy_sum = entropy_sum + torch.where(mb.loss_mask, entropy, 0.0).sum()
            del logits, logp, picked, logprobs, entropy, loss
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), optim.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        losses.append({"loss": float(loss_sum), "grad_norm": float(grad_norm),
                       "entropy": float(entropy_sum) / batch.num_loss_tokens})
        if step > args.warmup:
            times.append(time.perf_counter() - start)
    num_params = active_params(build_native(hf_config))  # counted on tandem's model of the same config (meta device)
    flops = model_flops(num_params, hf_config, shape.sequence_lengths)
    out = {"impl": "baseline", "options": {"model_class": type(model).__name__, "attention": "sdpa (default kernel order)",
                                           "experts": getattr(model.config, "_experts_implementation", None),
                                           "weights": "tandem's dummy weights, made on the device", "gradient_checkpointing": True,
                                           "logits": "full fp32", "optimizer": "torch AdamW (default implementation)",
                                           "precision": "fp32 master, bf16 autocast" if device.type == "cuda" else "fp32"},
           **timing(times, shape, flops, peak), **memory_figures(device), "active_params": num_params, "losses": losses}
    del model, optimizer
    return out


def attention_kernel_rates(hf_config: dict, seq_len: int, repeats: int = 10, warmup: int = 3) -> dict:
    """Forward + backward TFLOP/s of each SDPA kernel alone on one causal bf16 sequence of the model's heads.

    Every kernel is warmed up before any is timed: this runs first in the process, on a GPU whose clocks may still
    be low, and cuDNN builds its plans at its first call. Timed after one call each, cuDNN first, an H100 read
    32-58 TFLOP/s for cuDNN at 4,096 tokens and 334-480 at 16,384 (flash 155-163 and 263-264); warmed up, 299-311
    and 481-491 (flash 172-175 and 256), two runs each in one process."""
    from torch.nn.attention import sdpa_kernel

    from tandem.models.attention import SDPA_BACKENDS

    heads, kv_heads = hf_config["num_attention_heads"], hf_config["num_key_value_heads"]
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // heads
    q = torch.randn(1, heads, seq_len, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, seq_len, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    flops = 6 * heads * head_dim * seq_len**2  # one layer, forward and backward, causal

    def step(name: str) -> None:
        with sdpa_kernel([SDPA_BACKENDS[name]]):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv_heads)
            out.backward(torch.ones_like(out))

    rates: dict[str, float | str] = {}
    for name in ("cudnn", "flash"):
        try:
            for _ in range(warmup):
                step(name)
        except RuntimeError as err:
            rates[name] = f"unavailable: {err}"[:300]
    for name in ("cudnn", "flash"):
        if name in rates:
            continue
        sync(q.device)
        start = time.perf_counter()
        for _ in range(repeats):
            step(name)
        sync(q.device)
        rates[name] = flops * repeats / (time.perf_counter() - start) / 1e12
    return rates


def attempt(label: str, fn, *fn_args) -> dict:
    """Run one benchmark; an error (out of memory, a compile failure) is recorded, not raised."""
    try:
        return fn(*fn_args)
    except Exception as err:  # the harness keeps going: the other shapes still measure
        traceback.print_exc()
        return {"error": f"{type(err).__name__}: {err}"[:2000], "label": label}
    finally:
        reset_memory(torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))


def table_row(run: dict) -> dict:
    """One line of the per-shape table every result file keeps: tokens, ms/step, MFU, peak memory."""
    row = {"shape": run["shape"], "impl": run.get("impl", run.get("label")), "fp8": run.get("fp8", "off"),
           "tokens_per_step": run["seq_len"] * run["rows_per_step"]}
    if "error" in run:
        return row | {"error": run["error"][:200]}
    return row | {"ms_per_step": run["step_time_s"] * 1e3, "mfu": run["mfu"], "tokens_per_s": run["tokens_per_s"],
                  "peak_memory_gib": run["peak_memory_gib"]}


def fp8_ratios(runs: list[dict]) -> dict[str, dict[str, float]]:
    """Per shape, each FP8 recipe's tokens/s over the bf16 run's (first runs without error, compiled or not alike)."""
    def tokens_per_s(shape: str, fp8: str) -> float | None:
        found = [r for r in runs if r.get("impl") == "tandem" and r["shape"] == shape and r.get("fp8") == fp8 and "error" not in r]
        return found[0]["tokens_per_s"] if found else None

    ratios: dict[str, dict[str, float]] = {}
    for shape in dict.fromkeys(r["shape"] for r in runs):
        bf16 = tokens_per_s(shape, "off")
        for recipe in ("tensorwise", "rowwise"):
            fp8 = tokens_per_s(shape, recipe)
            if bf16 and fp8:
                ratios.setdefault(shape, {})[recipe] = fp8 / bf16
    return ratios


def summary(shape: Shape, result: dict) -> str:
    if "error" in result:
        return f"{shape} {result.get('impl', result['label'])}: FAILED {result['error'][:300]}"
    fp8 = f" fp8 {result['fp8']}" if result.get("fp8", "off") != "off" else ""
    return (f"{shape} {result['impl']}{fp8}: {result['tokens_per_s']:.0f} tokens/s, {result['step_time_s'] * 1e3:.0f} ms/step, "
            f"MFU {result['mfu']:.1%}, peak {result['peak_memory_gib']:.2f} GiB, options {result['options']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=list(PRESETS), default="tiny")
    parser.add_argument("--num-layers", type=int, default=None, help="cut the preset to this many blocks (one GPU)")
    parser.add_argument("--mtp-layers", type=int, default=None,
                        help="multi-token prediction layers kept after the blocks (default: the preset's; a trainer "
                             "holds them, frozen, in fp32 beside the blocks)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size of tandem (parallel.ep; under torchrun)")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size of tandem (parallel.cp; under torchrun)")
    parser.add_argument("--max-position-embeddings", type=int, default=None,
                        help="context length of the preset; past its own, RoPE is extended by YaRN")
    parser.add_argument("--shapes", type=Shape.parse, nargs="+", default=[Shape(2048, 4, 4)], help="SEQ_LEN:SAMPLES:ROWS of tandem runs")
    parser.add_argument("--baseline", type=Shape.parse, nargs="*", default=[], help="shapes (one sample per row) of baseline runs")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation happens here)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto", help="compute dtype of tandem")
    parser.add_argument("--ac", choices=["off", "selective", "full", "every_k"], default=None,
                        help="activation checkpointing (default: the config's)")
    parser.add_argument("--reshard-after-forward", choices=["on", "off"], default="on" if ParallelConfig().reshard_after_forward else "off",
                        help="parallel.reshard_after_forward: off keeps each block's gathered weights from forward to backward")
    parser.add_argument("--fsdp-at-one-rank", choices=["on", "off"], default="on" if ParallelConfig().fsdp_at_one_rank else "off",
                        help="parallel.fsdp_at_one_rank: on shards with FSDP2 at world size 1 too (the path before the plain one)")
    parser.add_argument("--chunk-size", type=int, default=None, help="logprob chunk in tokens (default: the config's)")
    parser.add_argument("--compile", choices=["auto", "on", "off"], default=KernelsConfig().compile)
    parser.add_argument("--compile-stack", choices=["on", "off"], default="on" if KernelsConfig().compile_stack else "off",
                        help="kernels.compile_stack: all blocks of a dense one-rank model as one compiled graph")
    parser.add_argument("--sdpa-backends", nargs="+", choices=["cudnn", "flash", "efficient", "math"],
                        default=KernelsConfig().sdpa_backends, help="SDPA kernels of one-document rows, most preferred first")
    parser.add_argument("--exact", action="store_true", help="`run.exact`: batch-invariant blocks, attention and head "
                        "(tandem.models.exact; on one H200 at 4,096 tokens a step about 4.7x the default's step time: "
                        "results/trainer-h200-2026-12-05.json)")
    parser.add_argument("--fp8", nargs="+", choices=["off", "tensorwise", "rowwise"], default=["off"],
                        help="run each tandem shape once per setting: off (bf16) or an FP8 training recipe (fp8.recipe)")
    parser.add_argument("--peak-flops", type=float, default=None, help="peak FLOP/s (default: see the docstring)")
    parser.add_argument("--commit", default=None, help="the commit measured (default: git's HEAD, which a copied tree may hold stale)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here (rewritten after each run)")
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR",
                        help="after a tandem shape's timed steps, profile three more steps into DIR (benchmarks/step_profile.py)")
    parser.add_argument("--profile-shapes", type=Shape.parse, nargs="+", default=None,
                        help="the --shapes that --profile profiles (default: all)")
    args = parser.parse_args(argv)
    unknown = [str(s) for s in args.profile_shapes or [] if s not in args.shapes]
    if unknown:
        parser.error(f"--profile-shapes {' '.join(unknown)}: not among --shapes")
    bad = [str(s) for s in args.baseline if s.samples_per_row != 1]
    if bad:
        parser.error(f"--baseline {' '.join(bad)}: the baseline runs rows of one sequence only (SAMPLES = 1)")
    world_size, is_main = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0")) == 0
    if world_size > 1 and (args.baseline or len(args.shapes) > 1 or len(args.fp8) > 1):
        parser.error(f"under torchrun (world size {world_size}) give one --shapes entry, one --fp8 setting and no "
                     "--baseline: the baseline is one process, and the process group lives as long as one run")
    uneven = [str(s) for s in args.shapes if s.rows % world_size]
    if uneven:
        parser.error(f"--shapes {' '.join(uneven)}: ROWS must be a multiple of the world size {world_size}")

    device = torch.device("cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu")
    if args.peak_flops is not None:
        peak, peak_note = args.peak_flops, "given"
    elif device.type == "cuda":
        peak, peak_note = H100_BF16_PEAK, "989e12 dense bf16 (H100/H200 datasheet)"
    else:
        peak, peak_note = measured_cpu_peak(), f"measured fp32 matmul peak of this process, {torch.get_num_threads()} threads"
    results = {"preset": args.preset, "num_layers": args.num_layers, "mtp_layers": args.mtp_layers,
               "max_position_embeddings": args.max_position_embeddings,
               "device": str(device), "mfu_formula": MFU_FORMULA, "peak_tflops": peak / 1e12, "peak_note": peak_note,
               "warmup_steps": args.warmup, "environment": environment(device, args.commit), "runs": []}
    if set(args.fp8) != {"off"}:
        from importlib.metadata import version

        results["environment"]["torchao"] = version("torchao")

    def record(shape: Shape, result: dict) -> None:
        if not is_main:  # rank 0 reports for all
            return
        results["runs"].append({"shape": str(shape), "seq_len": shape.seq_len, "samples_per_row": shape.samples_per_row,
                                "rows_per_step": shape.rows, **result})
        results["table"] = [table_row(run) for run in results["runs"]]
        print(summary(shape, result), file=sys.stderr, flush=True)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            tmp = args.out.with_suffix(".tmp")
            tmp.write_text(json.dumps(results, indent=1))
            tmp.replace(args.out)

    with tempfile.TemporaryDirectory() as tmp:
        config = preset_config(args.preset, args.num_layers, args.max_position_embeddings)
        if args.mtp_layers is not None:
            config["num_nextn_predict_layers"] = args.mtp_layers
        folder = write_model(config, Path(tmp) / "model", seed=0, weights=False)
        if device.type == "cuda" and is_main:
            hf_config = json.loads((folder / "config.json").read_text())
            results["attention_tflops_fwd_bwd"] = {"seq_len": args.shapes[0].seq_len,
                                                   **attention_kernel_rates(hf_config, args.shapes[0].seq_len)}
            print(f"attention kernels alone: {results['attention_tflops_fwd_bwd']}", file=sys.stderr, flush=True)
        # The first tandem shape, then the baselines (so the ratio exists early), then the rest.
        order = args.shapes[:1] + [None] + args.shapes[1:]
        for shape in order:
            if shape is None:
                for base in args.baseline:
                    record(base, attempt("baseline", run_baseline, folder, base, args, peak))
                continue
            kernels = KernelsConfig(compile=args.compile, compile_stack=args.compile_stack == "on", sdpa_backends=args.sdpa_backends)
            for fp8 in args.fp8:
                result = attempt("tandem", run_tandem, folder, shape, args, kernels, peak, fp8)
                record(shape, {**result, "fp8": fp8})
                if "error" in result and should_compile(kernels, device) and world_size == 1:
                    eager = KernelsConfig(compile="off", compile_stack=False, sdpa_backends=args.sdpa_backends)
                    record(shape, {**attempt("tandem", run_tandem, folder, shape, args, eager, peak, fp8), "fp8": fp8,
                                   "note": "rerun with kernels.compile = off after the compiled run failed"})
    ratios = {}
    for base in (r for r in results["runs"] if r.get("impl") == "baseline"):
        mine = [r for r in results["runs"] if r.get("impl") == "tandem" and r["shape"] == base["shape"] and "error" not in r]
        if mine:
            ratios[base["shape"]] = mine[0]["tokens_per_s"] / base["tokens_per_s"]
            print(f"{base['shape']}: tandem / baseline = {ratios[base['shape']]:.2f}x tokens/s", file=sys.stderr)
    results["ratio_to_baseline"] = ratios
    results["fp8_ratio_to_bf16"] = fp8_ratios(results["runs"])
    for shape, by_recipe in results["fp8_ratio_to_bf16"].items():
        for recipe, ratio in by_recipe.items():
            print(f"{shape}: fp8 {recipe} / bf16 = {ratio:.2f}x tokens/s", file=sys.stderr)
    if is_main:
        print(f"MFU = {MFU_FORMULA}", file=sys.stderr)
        for row in results.get("table", []):
            print("  ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), file=sys.stderr)
        if args.out is not None:
            args.out.write_text(json.dumps(results, indent=1))
        print(json.dumps({k: v for k, v in results.items() if k != "runs"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
