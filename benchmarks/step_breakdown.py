"""What a server's slow steps held, against its median ones: from its step records (`GET /engine/steps`).

A workload's tail of time between tokens is made by a few steps; each record (`tandem.inference.engine.step_records`)
says how the time since the previous one split and what the step it read held. This module takes the records of
one window (the decoding phase of a workload) that read tokens, marks each with the causes that could have made
it slow, and compares the slowest percent (interval at or above the p99) with the steps around the median: mean
parts and counts of each class, and per cause how many steps had it, how long they took and which share of the
slow steps did. A cause that is as common among the median steps as among the slow ones did not make them slow.
`device_ms` is the time the device worked on the call that launched the step read (its admissions included);
`num_blocked`, how often the engine thread blocked (for the interpreter lock, mostly) per step.

Causes:
- `joined`: a prompt handed over by a prefill server sampled its first token in the step;
- `imported`: handed-over KV blocks were written into the cache before its forward;
- `prefill_here`: its forward computed prompt tokens (a colocated server's chunked prefill);
- `eager`: it ran no CUDA graph (meaningful on CUDA only: every CPU step is eager);
- `batch_changed`: it sampled for another number of sequences than the step before;
- `gc`: garbage collection paused the process for over 1 ms in its interval;
- `host_bound`: the engine thread's host work (in and out of `step()`) took over half the interval;
- `starved`: the engine thread ran on a CPU for less than half of its host work's wall time (the interpreter lock
  held by the HTTP side, or no free core);
- `peer_busy`: another server on the same device (the prefill server beside a decode server) worked on prompt
  tokens on the device during the interval (from its records' busy times).
"""

from __future__ import annotations

CAUSES = ("joined", "imported", "prefill_here", "eager", "batch_changed", "gc", "host_bound", "starved", "peer_busy")

GC_PAUSE_S = 1e-3
"""A collection longer than this counts as a cause."""

PARTS = ("interval_s", "between_s", "host_s", "admit_s", "wait_s", "cpu_s", "gc_s")
"""The record's time parts, reported in milliseconds."""

COUNTS = ("num_seqs", "num_tokens", "num_prefill_tokens", "num_joined", "num_imported_tokens")
"""The step's shape, reported as means."""


def in_window(steps: list[dict], start: float, end: float) -> list[dict]:
    """The records whose whole interval lies in [start, end] (`time.perf_counter` of any process of the host)."""
    return [s for s in steps if s["end"] - s["interval_s"] >= start and s["end"] <= end]


def busy_windows(peer_steps: list[dict]) -> list[tuple[float, float]]:
    """When a peer server's device worked on prompt tokens: the busy times of its steps that computed some."""
    return sorted(tuple(s["launched"]["busy"]) for s in peer_steps
                  if s["launched"] is not None and s["launched"]["num_prefill_tokens"] > 0 and s["launched"]["busy"])


def device_s(step: dict) -> float | None:
    busy = step["read"]["busy"]
    return busy[1] - busy[0] if busy else None


def causes(steps: list[dict], peer_busy: list[tuple[float, float]] = ()) -> list[set[str]]:
    """The causes (see the module docstring) each of `steps` (in order) had."""
    marks, previous = [], None
    for step in steps:
        shape, start = step["read"], step["end"] - step["interval_s"]
        host = step["between_s"] + step["host_s"]
        mark = {name for name, holds in (
            ("joined", shape["num_joined"] > 0),
            ("imported", shape["num_imported_tokens"] > 0),
            ("prefill_here", shape["num_prefill_tokens"] > 0),
            ("eager", not shape["graph"]),
            ("batch_changed", previous is not None and shape["num_seqs"] != previous),
            ("gc", step["gc_s"] > GC_PAUSE_S),
            ("host_bound", host > step["interval_s"] / 2),
            ("starved", step["cpu_s"] - step["wait_s"] < host / 2),
            ("peer_busy", any(lo < step["end"] and hi > start for lo, hi in peer_busy)),
        ) if holds}
        marks.append(mark)
        previous = shape["num_seqs"]
    return marks


def summary(steps: list[dict], marks: list[set[str]]) -> dict:
    """Mean parts (ms) and shape of `steps`, and the fraction of them with each cause."""
    if not steps:
        return {"num_steps": 0}
    n = len(steps)
    out: dict = {"num_steps": n}
    out |= {f"{part.removesuffix('_s')}_ms": 1000 * sum(s[part] for s in steps) / n for part in PARTS}
    known = [t for t in map(device_s, steps) if t is not None]
    out["device_ms"] = 1000 * sum(known) / len(known) if known else None
    out |= {count: sum(s["read"][count] for s in steps) / n for count in COUNTS}
    out["num_blocked"] = sum(s["num_blocked"] for s in steps) / n
    out["causes"] = {cause: sum(cause in m for m in marks) / n for cause in CAUSES}
    return out


def breakdown(steps: list[dict], peer_steps: list[dict] = ()) -> dict:
    """The slow steps (interval >= p99) against the median ones (p40 to p60) of the records of `steps` that read
    tokens, and per cause: how many steps had it, their median interval, and the share of the slow steps that had
    it. `peer_steps`: the records of a server sharing the device."""
    steps = [s for s in steps if s["read"] is not None and s["read"]["num_seqs"] > 0]
    if not steps:
        return {"num_steps": 0}
    marks = causes(steps, busy_windows(list(peer_steps)))
    order = sorted(range(len(steps)), key=lambda i: steps[i]["interval_s"])
    rank = {i: r for r, i in enumerate(order)}
    n = len(steps)
    p50 = steps[order[n // 2]]["interval_s"]
    p99 = steps[order[int(n * 0.99)]]["interval_s"]
    slow = [i for i in range(n) if rank[i] >= int(n * 0.99)]
    median = [i for i in range(n) if int(n * 0.4) <= rank[i] <= int(n * 0.6)]
    by_cause = {}
    for cause in CAUSES:
        having = sorted(steps[i]["interval_s"] for i in range(n) if cause in marks[i])
        by_cause[cause] = {"num_steps": len(having),
                           "interval_p50_ms": 1000 * having[len(having) // 2] if having else None,
                           "share_of_slow": sum(cause in marks[i] for i in slow) / len(slow)}
    return {"num_steps": n, "interval_p50_ms": 1000 * p50, "interval_p99_ms": 1000 * p99,
            "interval_p99_over_p50": p99 / p50 if p50 > 0 else None,
            "slow": summary([steps[i] for i in slow], [marks[i] for i in slow]),
            "median": summary([steps[i] for i in median], [marks[i] for i in median]),
            "by_cause": by_cause}
