"""Where one training step's time goes: `benchmarks/trainer.py --profile DIR`.

For a shape, after its timed steps, three more steps run:
1. under `tandem.trainer.phases`, the device synchronised at every phase boundary: the wall-clock
   milliseconds of each phase alone (forward, logprobs, objective, backward, metrics, grad_clip,
   metrics_transfer, optimizer, zero_grad, schedule) and of what no phase covers;
2. the same under `torch.profiler` (CUDA only): the GPU busy time of each phase (the union of its
   kernels' intervals). A phase's wall time well above its busy time is time the GPU waits for the
   host: Python, dispatch, launches, hooks;
3. under `torch.profiler` (CPU, and CUDA where there is one), undisturbed: the top ops by self
   device time and by self CPU time, each phase's CPU time on the calling thread, the fraction of
   the step the GPU is busy (well below 1: the host is what the step waits for), the GPU's longest
   waits with what the host did meanwhile (`device_idle`), and a trace.

Then one publish of the weights is timed (`publish_ms`: the RL loop writes `weights/step_N/` after
every `weights.interval` steps, outside the step the benchmark times).

Everything goes to `DIR/<label>.json`, the trace to `DIR/<label>.trace.json.gz` (Perfetto, chrome://tracing).
Besides, every timed run counts what its timed steps did that a steady step should not: graphs
compiled by `torch.compile` and device allocations by the caching allocator (`once_only_counts`).
"""

from __future__ import annotations

import gzip
import json
import shutil
import time
from pathlib import Path
from typing import Callable

import torch

TOP_OPS = 30
"""Rows of each op table."""
IDLE_GAPS = 15
"""The device's longest waits listed per profiled step."""


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def once_only_counts(device: torch.device) -> dict[str, int]:
    """Counters of work a steady step should not repeat: graphs compiled, device memory allocated."""
    from torch._dynamo.utils import counters

    out = {"graphs_compiled": int(counters["stats"]["unique_graphs"]), "frames_compiled": int(counters["frames"]["total"])}
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        out |= {"cuda_mallocs": int(stats.get("num_device_alloc", 0)), "alloc_retries": int(stats.get("num_alloc_retries", 0))}
    return out


def counts_since(before: dict[str, int], device: torch.device) -> dict[str, int]:
    """How much each `once_only_counts` counter grew since `before`."""
    return {k: v - before.get(k, 0) for k, v in once_only_counts(device).items()}


def phase_times(run: Callable[..., object], inputs: tuple, device: torch.device) -> dict:
    """`run(*inputs)`, one step, with the device synchronised at each phase boundary: milliseconds per phase."""
    from tandem.trainer.phases import recording_phases  # imported here: an older tree, timed without --profile, lacks it

    sync(device)
    start = time.perf_counter()
    with recording_phases(device, synchronize=True) as times:
        run(*inputs)
    sync(device)
    step_ms = (time.perf_counter() - start) * 1e3
    phases = times.as_dict()
    return {"step_ms": step_ms, "phases": phases,
            "outside_phases_ms": step_ms - sum(p["self_ms"] for p in phases.values())}


def op_row(event) -> dict:
    return {"name": event.key, "calls": event.count, "self_device_ms": event.self_device_time_total / 1e3,
            "device_total_ms": event.device_time_total / 1e3, "self_cpu_ms": event.self_cpu_time_total / 1e3,
            "cpu_total_ms": event.cpu_time_total / 1e3}


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of [start, end) intervals as disjoint intervals, in order."""
    out: list[list[float]] = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def union_ms(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals in microseconds, as milliseconds."""
    return sum(hi - lo for lo, hi in merged(intervals)) / 1e3


def is_device_annotation(event) -> bool:
    """A `record_function` range drawn on the GPU's timeline: it spans kernels, it is none."""
    from torch.autograd import DeviceType

    return event.device_type != DeviceType.CPU and bool(getattr(event, "is_user_annotation", False))


def device_work(events) -> list:
    """The device's work among profiler events: kernels, copies, sets."""
    from torch.autograd import DeviceType

    return [e for e in events if e.device_type == DeviceType.CUDA and not is_device_annotation(e)]


def kernel_intervals(events) -> list[tuple[float, float]]:
    """[start, end) in microseconds of the device's work."""
    return [(e.time_range.start, e.time_range.end) for e in device_work(events)]


def idle_gaps(events, count: int = IDLE_GAPS) -> dict:
    """Where the device waits within a step: every stretch between its work (and before its first and after its last
    kernel, within the host's events), the `count` longest with what the host was doing then: the phase and the ops
    that cover most of the gap, the innermost first among equals.
    The host's ops during a gap name its cause: a sync it waits on, the Python between two launches, a phase's
    setup. Times in milliseconds from the first host event."""
    from torch.autograd import DeviceType

    host = [e for e in events if e.device_type == DeviceType.CPU]
    work = device_work(events)
    if not host or not work:
        return {}
    origin, finish = min(e.time_range.start for e in host), max(e.time_range.end for e in host)
    busy = merged([(e.time_range.start, e.time_range.end) for e in work])
    edges = [(origin, busy[0][0])] + [(a[1], b[0]) for a, b in zip(busy, busy[1:])] + [(busy[-1][1], finish)]
    gaps = [(lo, hi) for lo, hi in edges if hi > lo]
    ending = {e.time_range.end: e.key for e in work}
    starting = {e.time_range.start: e.key for e in work}

    def described(lo: float, hi: float) -> dict:
        def cover(e) -> float:
            return min(hi, e.time_range.end) - max(lo, e.time_range.start)

        holding = sorted((e for e in host if cover(e) > 0), key=lambda e: (-cover(e), -e.time_range.start))
        phases = [e.key.removeprefix("step/") for e in holding if e.key.startswith("step/")]
        return {"start_ms": (lo - origin) / 1e3, "ms": (hi - lo) / 1e3, "phase": phases[0] if phases else None,
                "host_ops": [e.key for e in holding if not e.key.startswith("step/")][:4],
                "after_kernel": ending.get(lo), "before_kernel": starting.get(hi)}

    return {"idle_ms": sum(hi - lo for lo, hi in gaps) / 1e3, "gaps": len(gaps),
            "longest": [described(lo, hi) for lo, hi in sorted(gaps, key=lambda g: g[0] - g[1])[:count]]}


def busy_by_phase(events) -> dict[str, float]:
    """GPU busy milliseconds of each phase of a synchronised step: each kernel counts for the innermost phase
    whose range holds it (synchronised, a phase's kernels run inside its range); "outside phases" for the rest."""
    from torch.autograd import DeviceType

    ranges = [(e.time_range.start, e.time_range.end, e.key.removeprefix("step/")) for e in events
              if e.key.startswith("step/") and e.device_type == DeviceType.CPU]
    assigned: dict[str, list[tuple[float, float]]] = {}
    for lo, hi in kernel_intervals(events):
        mid = (lo + hi) / 2
        holders = [r for r in ranges if r[0] <= mid <= r[1]]
        name = min(holders, key=lambda r: r[1] - r[0])[2] if holders else "outside phases"
        assigned.setdefault(name, []).append((lo, hi))
    return {name: union_ms(intervals) for name, intervals in assigned.items()}


def synchronised_step(run: Callable[..., object], inputs: tuple, device: torch.device) -> dict:
    """`run(*inputs)`, one step, synchronised at each phase boundary under `torch.profiler`: each phase's GPU busy
    time (on CUDA), to set beside its wall-clock time measured without the profiler."""
    from torch.profiler import ProfilerActivity, profile

    from tandem.trainer.phases import recording_phases

    if device.type != "cuda":
        return {}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with recording_phases(device, synchronize=True):
            run(*inputs)
        sync(device)
    return busy_by_phase(prof.events())


def write_trace(prof, path: Path) -> None:
    """The chrome trace, gzipped by us (not every torch release gzips a `.gz` path itself)."""
    plain = path.with_name(path.name.removesuffix(".gz"))
    prof.export_chrome_trace(str(plain))
    with plain.open("rb") as src, gzip.open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    plain.unlink()


def profiled_step(run: Callable[..., object], inputs: tuple, device: torch.device, trace: Path) -> dict:
    """`run(*inputs)`, one step under `torch.profiler`, phases marked but not synchronised: op tables, each phase's
    CPU time (the calling thread's: CUDA runs backward on a thread of its own), the GPU's busy fraction, a trace."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from tandem.trainer.phases import recording_phases

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        with recording_phases(device, synchronize=False):
            run(*inputs)
        sync(device)
        step_ms = (time.perf_counter() - start) * 1e3
    write_trace(prof, trace)
    averages = prof.key_averages()
    ops = [e for e in averages if not e.key.startswith("step/") and not is_device_annotation(e)]
    phases = {e.key.removeprefix("step/"): {"calls": e.count, "cpu_total_ms": e.cpu_time_total / 1e3}
              for e in averages if e.key.startswith("step/") and e.device_type == DeviceType.CPU}
    events = prof.events()
    kernels = kernel_intervals(events)
    gpu_busy = union_ms(kernels) if kernels else None
    return {"step_ms_under_profiler": step_ms, "gpu_busy_ms": gpu_busy,
            "gpu_busy_fraction": None if gpu_busy is None else gpu_busy / step_ms, "phases": phases,
            "top_ops_by_self_device_time": [op_row(e) for e in sorted(ops, key=lambda e: -e.self_device_time_total)[:TOP_OPS]],
            "top_ops_by_self_cpu_time": [op_row(e) for e in sorted(ops, key=lambda e: -e.self_cpu_time_total)[:TOP_OPS]],
            "device_idle": idle_gaps(events), "trace": trace.name}


def timed_ms(fn: Callable[[], object], device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return (time.perf_counter() - start) * 1e3


def profile_shape(run: Callable[..., object], inputs: Callable[[], tuple], device: torch.device, folder: Path,
                  label: str, publish: Callable[[], object]) -> dict:
    """The profiles of one shape (see the module docstring), each of a step `run(*inputs())` (its inputs made
    before it starts), and the milliseconds of one `publish()`; writes `folder/<label>.json` and returns its content."""
    folder.mkdir(parents=True, exist_ok=True)
    synced = phase_times(run, inputs(), device)
    busy = synchronised_step(run, inputs(), device)
    for name, times in synced["phases"].items():
        times["gpu_busy_ms"] = busy.get(name)
    synced["outside_phases_gpu_busy_ms"] = busy.get("outside phases")
    report = {"label": label, "synchronised_phases": synced,
              "profiler": profiled_step(run, inputs(), device, folder / f"{label}.trace.json.gz"),
              "publish_ms": timed_ms(publish, device)}
    tmp = folder / f"{label}.json.tmp"
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(folder / f"{label}.json")
    return report


def phase_summary(report: dict) -> str:
    """One line: the synchronised phases, longest first, and the GPU's busy fraction."""
    synced = report["synchronised_phases"]
    parts = ", ".join(f"{name} {p['self_ms']:.1f}" + ("" if p["gpu_busy_ms"] is None else f" (GPU busy {p['gpu_busy_ms']:.1f})")
                      for name, p in synced["phases"].items())
    busy = report["profiler"]["gpu_busy_fraction"]
    return (f"step {synced['step_ms']:.1f} ms synchronised: {parts}, outside phases {synced['outside_phases_ms']:.1f}"
            + ("" if busy is None else f"; unsynchronised under the profiler the GPU is busy {busy:.0%} of the step")
            + f"; publishing the weights {report['publish_ms']:.0f} ms")
