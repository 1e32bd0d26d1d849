"""Copies between host and device that never make the host wait for the GPU.

Why: the engine schedules and launches step N+1 while the GPU still runs step N (`llm_engine.py`).
One copy from pageable memory (the driver may stage it behind the stream's work) or one
`.tolist()` of a device tensor would make the host wait for step N and undo that overlap. So lists
reach the device through pinned staging memory, and device results land in pinned memory, waited
for only when the host needs the values. On CPU both are plain tensors.
"""

from __future__ import annotations

import torch


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor, copied without waiting for the device's queued work."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    # The caching host allocator keeps the pinned block until the copy has run.
    return host.pin_memory().to(device, non_blocking=True)


class HostRead:
    """Device tensors on their way to host memory: copies queued now, `values()` waits for them only."""

    def __init__(self, tensors: list[torch.Tensor]):
        self._event: torch.cuda.Event | None = None
        if not tensors or not tensors[0].is_cuda:
            self._host = tensors
            return
        self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for host, tensor in zip(self._host, tensors):
            host.copy_(tensor, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def values(self) -> list[torch.Tensor]:
        """The host copies, once they have landed."""
        if self._event is not None:
            self._event.synchronize()
        return self._host
