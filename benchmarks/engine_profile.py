"""Where an engine step's GPU time goes, by kernel group: `inference.py --profile` and `profile_engine.py`.

A few prefill steps and a few decode steps (after the prompts are in) run under `torch.profiler`; every kernel the
GPU ran, those of CUDA-graph replays included, goes to the first group whose name patterns it matches (`GROUPS`):
the dense products in FP8 (the Triton kernel, cuBLAS's block-scaled one) and in bf16 (cuBLAS; the LM head, and
every projection of a bf16 engine), the quantization of activations before FP8 products, the routed experts (the
fused MoE kernels: layout and grouped matmuls), attention, the pointwise kernels (norms, RoPE, SiLU * up, compiled
fusions), and the rest. Per phase: milliseconds of GPU time per step by group, and the kernels that take most.
"""

from __future__ import annotations

import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from tandem.inference.engine.sampling_params import SamplingParams

GROUPS = (
    ("activation_quantization", ("_quantize_kernel",)),
    ("experts", ("_grouped_matmul_kernel", "_count_kernel", "_place_groups_kernel", "_scatter_kernel", "moe")),
    # cuBLAS's block-scaled FP8 products are nvjet kernels named with a quantized A and B ("qq") and 128-blocks
    ("fp8_products", ("_matmul_kernel", "e4m3", "f8f8", "fp8", "_qqtst_", "ablk128")),
    ("attention", ("attention", "_split_decode_kernel", "_combine_splits_kernel", "_shared_prefix_kernel",
                   "_own_keys_kernel", "_merge_kernel", "flash", "fmha")),
    ("pointwise", ("_rms_norm_kernel", "_silu_mul_kernel", "_qk_norm_rope_write_kernel", "triton_poi", "triton_red",
                   "triton_per")),
    ("bf16_products", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "splitk", "_linear_kernel")),
)
"""Kernel groups, each with the substrings (lower case) of the kernel names it takes; the first match wins (the
grouped expert matmul before the dense `_matmul_kernel`). What matches none is `other`."""
TOP_KERNELS = 15
"""Kernels listed per phase."""
TOP_LAUNCHERS = 8
"""Launchers listed per phase for the GPU's idle time (`gpu_idle`)."""
NOT_LINKED = "(no host op: a CUDA graph's replay, or the runtime's own)"
"""The launcher of a device activity the profiler links to no host op."""


def kernel_group(name: str) -> str:
    lowered = name.lower()
    return next((group for group, patterns in GROUPS if any(p.lower() in lowered for p in patterns)), "other")


def grouped_kernels(prof: profile, steps: int) -> dict:
    """GPU milliseconds per step of each kernel group, and of the kernels that take most, from a profile of `steps`."""
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            kernels.setdefault(event.name, []).append(event.time_range.elapsed_us() / 1e3)
    groups = {group: 0.0 for group, _ in GROUPS} | {"other": 0.0}
    for name, times in kernels.items():
        groups[kernel_group(name)] += sum(times) / steps
    total = sum(groups.values())
    top = sorted(kernels.items(), key=lambda item: -sum(item[1]))[:TOP_KERNELS]
    return {"gpu_ms_per_step": total, "groups_ms_per_step": groups,
            "top_kernels": [{"name": name[:120], "group": kernel_group(name), "calls_per_step": len(times) / steps,
                             "ms_per_step": sum(times) / steps} for name, times in top]}


def device_activities(prof: profile) -> list[tuple[float, float, str]]:
    """Every device activity of a profile (kernels, copies, sets): start and end in microseconds, and the host code
    that launched it (`launcher`)."""
    host = {event.id: event for event in prof.events() if event.device_type == DeviceType.CPU}
    return [(a.start_ns() / 1e3, a.end_ns() / 1e3, launcher(host.get(a.linked_correlation_id())))
            for a in prof.profiler.kineto_results.events() if a.device_type() == DeviceType.CUDA]


def launcher(op) -> str:
    """The innermost of tandem's Python frames around host op `op` (a profile taken `with_stack`), else the op."""
    if op is None:
        return NOT_LINKED
    frame = op
    while frame is not None and "tandem/" not in frame.name:
        frame = frame.cpu_parent
    return frame.name[frame.name.index("tandem/"):] if frame is not None else op.name


def gpu_idle(activities: list[tuple[float, float, str]], steps: int) -> dict:
    """The device's idle time between its first activity's start and its last one's end (intervals in microseconds,
    each with its launcher), per step: in all, and by the launcher of the activity that ended each gap: the host code
    the device waited for, where the host was late (a gap can also be a wait on the host's own reads)."""
    idle, by_launcher = 0.0, {}
    busy_until = None
    for start, end, name in sorted(activities):
        if busy_until is not None and start > busy_until:
            gap = by_launcher.setdefault(name, [0.0, 0])
            gap[0] += start - busy_until
            gap[1] += 1
            idle += start - busy_until
        busy_until = end if busy_until is None else max(busy_until, end)
    top = sorted(by_launcher.items(), key=lambda item: -item[1][0])[:TOP_LAUNCHERS]
    return {"gpu_idle_ms_per_step": idle / 1e3 / steps,
            "idle_before": [{"launcher": name, "ms_per_step": us / 1e3 / steps, "gaps_per_step": n / steps}
                            for name, (us, n) in top]}


def print_phase(label: str, phase: str, figures: dict) -> None:
    print(f"--- {label} {phase}: {figures['wall_per_step_s'] * 1e3:.2f} ms per step (wall), "
          f"{figures['gpu_ms_per_step']:.2f} ms of kernels", flush=True)
    for group, ms in figures["groups_ms_per_step"].items():
        print(f"  {group:<24} {ms:8.3f} ms  {ms / max(figures['gpu_ms_per_step'], 1e-9):6.1%}")
    for kernel in figures["top_kernels"]:
        print(f"  {kernel['ms_per_step']:8.3f} ms  {kernel['calls_per_step']:6.1f} calls  {kernel['group']:<24} "
              f"{kernel['name'][:90]}")
    if "gpu_idle_ms_per_step" in figures:
        print(f"  GPU idle {figures['gpu_idle_ms_per_step']:.3f} ms per step; before the activities of (traced apart):")
        for gap in figures["idle_before"]:
            print(f"  {gap['ms_per_step']:8.3f} ms  {gap['gaps_per_step']:6.1f} gaps  {gap['launcher'][:100]}")


def profiled_steps(engine, prompts: list[list[int]], output_len: int, num_decode: int, label: str = "") -> dict:
    """Add `prompts` (each to `output_len` tokens) and profile two prefill steps, then, once every prompt is in and
    8 more steps ran, `num_decode` decode steps; the requests then run to their end. On CUDA each phase also gives
    the GPU's idle time per step, and, from as many more steps traced with Python stacks (slower on the host, so
    apart), the host code each idle gap waited for (`gpu_idle`)."""
    params = SamplingParams(max_tokens=output_len, temperature=1.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"profiled-{i}", prompt, params, incremental=False)
    out = {}
    for phase in ("prefill", "decode"):
        if phase == "decode":
            while engine.scheduler.waiting or not all(s.num_computed_tokens >= s.num_prompt_tokens for s in engine.scheduler.running):
                engine.step()
            for _ in range(8):  # past the first decode steps
                engine.step()
        synchronize(engine.device)
        steps = 2 if phase == "prefill" else num_decode
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.step()
            synchronize(engine.device)
            wall = (time.perf_counter() - t0) / steps
        out[phase] = {"wall_per_step_s": wall, "steps": steps, **grouped_kernels(prof, steps)}
        if engine.device.type == "cuda":  # the idle time untraced; its launchers from as many steps traced
            out[phase]["gpu_idle_ms_per_step"] = gpu_idle(device_activities(prof), steps)["gpu_idle_ms_per_step"]
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as traced:
                for _ in range(steps):
                    engine.step()
                synchronize(engine.device)
            out[phase]["idle_before"] = gpu_idle(device_activities(traced), steps)["idle_before"]
        print_phase(label, phase, out[phase])
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60), flush=True)
    while engine.has_unfinished:
        engine.step()
    return out


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def print_comparison(profiles: dict[str, dict]) -> None:
    """Per phase, each group's GPU milliseconds per step side by side, one column per engine variant (label: the
    result of `profiled_steps`)."""
    for phase in ("prefill", "decode"):
        columns = {label: p[phase] for label, p in profiles.items() if phase in p}
        if not columns:
            continue
        print(f"--- {phase}: GPU ms per step by kernel group")
        print(f"  {'group':<24}" + "".join(f"{label:>14}" for label in columns))
        for group in [g for g, _ in GROUPS] + ["other"]:
            print(f"  {group:<24}" + "".join(f"{c['groups_ms_per_step'][group]:14.3f}" for c in columns.values()))
        print(f"  {'all kernels':<24}" + "".join(f"{c['gpu_ms_per_step']:14.3f}" for c in columns.values()))
        if all("gpu_idle_ms_per_step" in c for c in columns.values()):
            print(f"  {'GPU idle':<24}" + "".join(f"{c['gpu_idle_ms_per_step']:14.3f}" for c in columns.values()))
        print(f"  {'wall':<24}" + "".join(f"{c['wall_per_step_s'] * 1e3:14.3f}" for c in columns.values()), flush=True)
