"""Named phases of a training step, for profiling: where a step's time goes, found rather than guessed.

The step's code marks its phases (`with phase("optimizer"): ...`). Outside a recording this costs
one global lookup per phase and changes nothing: no range, no sync. Inside `recording_phases`:
- each phase is a `record_function` range, so a `torch.profiler` trace shows it and attributes
  the CPU ops and CUDA kernels launched inside it to it (`step/<name>`);
- with `synchronize`, the device is synchronised at every phase boundary and the wall-clock time
  of each phase is added up. A synchronised phase's time is its work alone, CPU and device, with no
  overlap with its neighbours: a phase much longer than its kernels is bound by the host.

Phases nest (the logprob head runs inside the model's forward); a phase's `self` time excludes the
phases inside it, so the `self` times of one step add up to the time spent in any phase.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch


@dataclass
class PhaseTimes:
    """Wall-clock seconds per phase name, summed over the calls of a recording."""

    device: torch.device
    """The device synchronised at the boundaries (CUDA; a CPU runs in order anyway)."""
    synchronize: bool
    """Synchronise the device at each boundary and time the phases (else: ranges only)."""
    total: dict[str, float] = field(default_factory=dict)
    """Seconds inside the phase, phases nested in it included."""
    self: dict[str, float] = field(default_factory=dict)
    """Seconds inside the phase, phases nested in it excluded."""
    calls: dict[str, int] = field(default_factory=dict)
    """Times the phase was entered."""
    _open: list[float] = field(default_factory=list)
    """Seconds spent in the phases nested in each open phase, innermost last."""

    def sync(self) -> None:
        if self.synchronize and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def as_dict(self) -> dict[str, dict[str, float]]:
        """{name: {"total_ms", "self_ms", "calls"}}, longest self time first."""
        names = sorted(self.self, key=self.self.get, reverse=True)
        return {n: {"total_ms": self.total[n] * 1e3, "self_ms": self.self[n] * 1e3, "calls": self.calls[n]} for n in names}


_recording: PhaseTimes | None = None


@contextlib.contextmanager
def recording_phases(device: torch.device, synchronize: bool) -> Iterator[PhaseTimes]:
    """Record the phases the code run inside marks (one recording at a time)."""
    global _recording
    if _recording is not None:
        raise RuntimeError("phases are already being recorded")
    _recording = PhaseTimes(device, synchronize)
    try:
        yield _recording
    finally:
        _recording = None


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark the code inside as the phase `name` of a step (see the module docstring)."""
    times = _recording
    if times is None:
        yield
        return
    with torch.profiler.record_function(f"step/{name}"):
        if not times.synchronize:
            yield
            return
        times.sync()
        start = time.perf_counter()
        times._open.append(0.0)
        try:
            yield
        finally:
            times.sync()
            elapsed = time.perf_counter() - start
            nested = times._open.pop()
            times.total[name] = times.total.get(name, 0.0) + elapsed
            times.self[name] = times.self.get(name, 0.0) + elapsed - nested
            times.calls[name] = times.calls.get(name, 0) + 1
            if times._open:
                times._open[-1] += elapsed
