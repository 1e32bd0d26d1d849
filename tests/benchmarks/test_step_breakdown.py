"""`benchmarks/step_breakdown.py`: the slow steps are compared with the median ones, and each cause is counted where
the records show it (a handed-over prompt joining, a peer server busy on the device, a GC pause)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import step_breakdown  # noqa: E402


def record(end: float, interval: float, joined: int = 0, gc: float = 0.0, num_seqs: int = 8, blocked: int = 1) -> dict:
    shape = {"launched_at": end - interval / 2, "num_seqs": num_seqs, "num_tokens": num_seqs, "num_prefill_tokens": 0,
             "num_joined": joined, "num_imported_tokens": 100 * joined, "graph": True, "busy": (end - interval, end)}
    return {"end": end, "interval_s": interval, "between_s": interval / 10, "host_s": interval / 10, "admit_s": 0.0,
            "wait_s": 0.8 * interval, "cpu_s": interval, "gc_s": gc, "num_blocked": blocked, "read": shape,
            "launched": shape}


def test_slow_steps_are_told_apart_by_what_they_held():
    """200 steps of 10 ms; every 50th has a prompt joining and takes 30 ms; the last of them also overlaps the peer's prompt
    work; one plain step is stretched by a 5 ms GC pause."""
    steps, end = [], 100.0
    for i in range(200):
        interval = 0.030 if i % 50 == 25 else 0.015 if i == 120 else 0.010
        end += interval
        steps.append(record(end, interval, joined=int(i % 50 == 25), gc=0.005 if i == 120 else 0.0,
                            blocked=5 if i % 50 == 25 else 1))
    peer_from = steps[175]["end"] - 0.005
    peer = [{"end": peer_from + 0.050, "launched": {"num_prefill_tokens": 4096, "busy": (peer_from, peer_from + 0.050)}},
            {"end": 0.0, "launched": None}]
    result = step_breakdown.breakdown(steps, peer)
    assert result["num_steps"] == 200
    assert round(result["interval_p50_ms"], 6) == 10 and round(result["interval_p99_ms"], 6) == 30
    slow, median = result["slow"], result["median"]
    assert slow["num_steps"] == 2 and slow["causes"]["joined"] == 1 and median["causes"]["joined"] == 0
    assert slow["num_imported_tokens"] == 100 and round(slow["interval_ms"], 6) == 30
    assert slow["device_ms"] > median["device_ms"]
    assert slow["num_blocked"] == 5 and median["num_blocked"] == 1
    causes = result["by_cause"]
    assert causes["joined"]["num_steps"] == 4 and causes["joined"]["share_of_slow"] == 1
    assert causes["gc"]["num_steps"] == 1 and causes["gc"]["share_of_slow"] == 0
    # The peer's 50 ms of prompt work overlaps step 175 (a joining one, among the two slowest) and the steps within 50 ms after it.
    assert 2 <= causes["peer_busy"]["num_steps"] <= 6 and causes["peer_busy"]["share_of_slow"] == 0.5
    assert causes["batch_changed"]["num_steps"] == 0 and causes["eager"]["num_steps"] == 0


def test_only_records_that_read_tokens_inside_the_window_count():
    steps = [record(1.0, 0.01), record(2.0, 0.01), record(3.0, 0.01)]
    steps[1] = {**steps[1], "read": None}
    assert step_breakdown.in_window(steps, 1.5, 3.5) == steps[1:]
    assert step_breakdown.breakdown(step_breakdown.in_window(steps, 1.5, 3.5))["num_steps"] == 1
    assert step_breakdown.breakdown([]) == {"num_steps": 0}
