"""A record per engine step: when its tokens came out, where the time between two went, and what the step held.

Why: a server's slow steps (a time between tokens well above the median) have several possible causes (prompts
handed over by a prefill server joining the batch and their KV blocks written in, the batch changing size and no
CUDA graph replaying, the engine thread's host work or the interpreter lock held by the HTTP side, garbage
collection, another process computing on the same device); a benchmark attributes them by comparing what the slow
steps held with what the median ones did. So each record splits the time since the previous record into the
engine thread's time before `step()` (`between_s`), its host work inside (`host_s`, of which `admit_s` took
handed-over prompts in) and its wait for the device (`wait_s`); it counts the engine thread's CPU time and how often
the thread blocked (`cpu_s`, `num_blocked`: waiting for the interpreter lock, which the HTTP side's Python work
holds, blocks the thread without costing it CPU time); and it holds the shape (`StepShape`) of the step whose
tokens the call read and of the one it launched (with overlapped steps, the one read next), each with the time the
device worked on it.

Cheap by design: a few clock reads, one `getrusage` call, two CUDA events and one append to a bounded deque per
step, no device sync (the events' times are read when the records are, from events that have completed by then).
Off unless `engine.num_step_records` > 0. Times are `time.perf_counter()`, the system's monotonic clock on Linux, so
records of two servers on one host (a prefill and a decode server sharing a GPU) line up.
"""

from __future__ import annotations

import gc
import resource
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class StepShape:
    """What a launched step held, and when the device worked on it."""

    launched_at: float
    """When the host launched its forward."""
    num_seqs: int
    """Sequences that sample a token in it (the batch as the clients see it; 0: a step of prompt chunks only)."""
    num_tokens: int
    """Tokens its forward computed."""
    num_prefill_tokens: int
    """Of those, prompt tokens (chunks of prompts computed here)."""
    num_joined: int
    """Sequences continued from a prompt another engine prefilled, sampling their first token in it."""
    num_imported_tokens: int
    """KV tokens of handed-over prompts written into the cache in the same `step()`, before its forward."""
    graph: bool
    """Its forward replayed a CUDA graph."""
    busy: tuple[float, float] | None = None
    """From when to when the device worked on the `step()` that launched it, admitting handed-over prompts included
    (CUDA: between two events on the engine's stream; the CPU: the call, whose host computes it); None until known."""
    events: tuple[torch.cuda.Event, torch.cuda.Event | None] | None = None
    """CUDA: the events around that work (the second recorded once the call ends)."""

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__ if name != "events"}


@dataclass(slots=True)
class StepRecord:
    end: float
    """When the `step()` call ended (the host has the tokens it read)."""
    interval_s: float
    """Since the previous record's `end` (between two steps' tokens: what a streaming client sees)."""
    between_s: float
    """Of the interval, the time before this `step()` began: the engine thread outside `step()` (applying commands
    such as new requests and hand-offs, delivering outputs, idle)."""
    host_s: float
    """Of the interval, the engine thread's time inside `step()` not waiting for the device."""
    admit_s: float
    """Of `host_s`, admitting handed-over prompts (their blocks allocated and the copy into the cache queued)."""
    wait_s: float
    """Of the interval, waiting for the device to finish the step read (0 on the CPU, where the host computes it)."""
    cpu_s: float
    """The engine thread's CPU time over the interval. Below `interval_s - wait_s` the thread could not run: another
    thread held the interpreter lock, or no core was free. (A CUDA wait spins, so it counts here too.)"""
    gc_s: float
    """Garbage collection, in any thread of the process, over the interval (it stops every Python thread)."""
    num_blocked: int
    """How often the engine thread blocked over the interval (its voluntary context switches): for the interpreter
    lock while another thread held it, mostly, as each torch call lets go of the lock; a CUDA wait spins instead."""
    read: StepShape | None
    """The step whose tokens this call read (the one it launched, or with overlapped steps the previous one)."""
    launched: StepShape | None
    """The step this call launched."""

    def as_dict(self) -> dict:
        out = {name: getattr(self, name) for name in self.__slots__}
        out["read"] = self.read.as_dict() if self.read is not None else None
        out["launched"] = self.launched.as_dict() if self.launched is not None else None
        return out


def num_blocked() -> int:
    """The calling thread's voluntary context switches so far: the times it blocked (a lock, a sleep, I/O)."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw


class GCClock:
    """Seconds this process spent collecting garbage so far, from `gc.callbacks` (one per process)."""

    _instance: GCClock | None = None

    def __init__(self):
        self.total_s = 0.0
        self._start = 0.0
        gc.callbacks.append(self._callback)

    @classmethod
    def shared(cls) -> GCClock:
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.total_s += time.perf_counter() - self._start


class StepRecords:
    """The last `size` records of one engine; only the engine thread writes, any thread may take a snapshot."""

    def __init__(self, size: int, device: torch.device):
        self.records: deque[StepRecord] = deque(maxlen=size)
        self.gc = GCClock.shared()
        self._anchor: tuple[torch.cuda.Event, float] | None = None
        """CUDA: an event and the host clock when it completed, which every other event's time is counted from."""
        if device.type == "cuda":
            anchor = torch.cuda.Event(enable_timing=True)
            anchor.record()
            anchor.synchronize()
            self._anchor = (anchor, time.perf_counter())
        self._last_end = time.perf_counter()
        self._last_cpu: float | None = None
        """The engine thread's CPU clock at the last record (`time.thread_time` is per thread: read there only)."""
        self._last_blocked = 0
        """The engine thread's voluntary context switches at the last record (per thread too)."""
        self._last_gc = self.gc.total_s
        self._step_start = 0.0
        self._start_event: torch.cuda.Event | None = None
        self._wait_s = 0.0
        self._read: StepShape | None = None
        self._launched: StepShape | None = None
        self.admit_s = 0.0
        self.num_imported_tokens = 0
        """KV tokens written in from hand-offs in the current `step()` (the engine adds to it, `shape` takes it)."""

    def start_step(self) -> None:
        self._step_start = time.perf_counter()
        if self._last_cpu is None:
            self._last_cpu, self._last_blocked = time.thread_time(), num_blocked()
        if self._anchor is not None:
            self._start_event = torch.cuda.Event(enable_timing=True)
            self._start_event.record()
        self._wait_s = self.admit_s = 0.0
        self.num_imported_tokens = 0
        self._read = self._launched = None

    @contextmanager
    def admitting(self) -> Iterator[None]:
        """Time the enclosed admission of handed-over prompts into `admit_s`."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.admit_s += time.perf_counter() - start

    def shape(self, num_seqs: int, num_tokens: int, num_prefill_tokens: int, num_joined: int, graph: bool) -> StepShape:
        """The shape of the step being launched now by the current `step()`."""
        self._launched = StepShape(time.perf_counter(), num_seqs, num_tokens, num_prefill_tokens, num_joined,
                                   self.num_imported_tokens, graph)
        if self._start_event is not None:
            self._launched.events = (self._start_event, None)
        return self._launched

    def read(self, shape: StepShape | None, waited_s: float) -> None:
        """The current `step()` read the step of `shape`, waiting `waited_s` for the device."""
        self._wait_s += waited_s
        self._read = shape

    def end_step(self) -> None:
        """The current `step()` ends: a record, if it read or launched a step (else its time counts towards the
        next record)."""
        if self._read is None and self._launched is None:
            return
        end, cpu, blocked, gc_total = time.perf_counter(), time.thread_time(), num_blocked(), self.gc.total_s
        if self._launched is not None:
            if self._launched.events is not None:
                done = torch.cuda.Event(enable_timing=True)
                done.record()
                self._launched.events = (self._launched.events[0], done)
            else:
                self._launched.busy = (self._step_start, end)
        inside = end - self._step_start
        self.records.append(StepRecord(end, end - self._last_end, self._step_start - self._last_end,
                                       inside - self._wait_s, self.admit_s, self._wait_s, cpu - self._last_cpu,
                                       gc_total - self._last_gc, blocked - self._last_blocked, self._read,
                                       self._launched))
        self._last_end, self._last_cpu, self._last_blocked, self._last_gc = end, cpu, blocked, gc_total

    def snapshot(self) -> list[dict]:
        """The records as plain dicts, oldest first (from any thread: a copy of the deque is taken at once); the
        device's busy times resolved where their events have completed."""
        records = list(self.records)
        for record in records:
            if record.launched is not None and record.launched.busy is None:
                self._resolve(record.launched)
        return [record.as_dict() for record in records]

    def _resolve(self, shape: StepShape) -> None:
        start, done = shape.events
        if done is None or not done.query():
            return
        anchor, anchor_time = self._anchor
        shape.busy = (anchor_time + anchor.elapsed_time(start) / 1000, anchor_time + anchor.elapsed_time(done) / 1000)
        shape.events = None
