"""One copy of a LoRA run's frozen base, held by the trainer and mapped by the engine (`lora.share_base`).

Why: with LoRA the base never changes, so a trainer and an engine on one device need not each hold it; for an 8B
model in bf16 that is 15 GiB, most of a 24 GiB card. The trainer lays out every frozen tensor in one buffer
(`SharedBuffer`) that another process can map: on CUDA one device allocation, exported by CUDA IPC
(`torch.multiprocessing.reductions`); on the CPU a file in shared memory (`/dev/shm` where there is one). The tensors
a decoder block multiplies as one stacked matrix (`tandem.models.stacked_projections.stacked_groups`: q/k/v, gate/up)
are laid end to end, so the engine's stacked projections are views of the buffer too, not copies.

The wire format: `shared_base.json` in the run folder (`shared_base_file`), written by the trainer (tmp + rename)
once the values are in the buffer, read by each inference server at start:
    {"pid": the trainer's process id, "device": "cuda" | "cpu", "nbytes": the buffer's size in bytes,
     "buffer": on CUDA the arguments of torch's `rebuild_cuda_tensor` by name (bytes as {"bytes": base64},
               dtypes as {"dtype": name}, classes as {"class": name}); on the CPU {"path": the shared file},
     "tensors": [{"name": HF name, "dtype": "bfloat16", "shape": [...], "offset": byte offset in the buffer}, ...]}
Invariant: the buffer lives as long as the trainer's process. A CPU mapping outlives it (the file's pages stay
while mapped); a CUDA mapping does not, so the trainer holds the buffer until the run is stopped
(`tandem.trainer.shared_base.hold_for_servers`), and the launcher ends the run when either process dies.
"""

from __future__ import annotations

import base64
import inspect
import json
import os
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.transport.files import atomic_write_text
from tandem.transport.paths import shared_base_file

ALIGNMENT = 256
"""Byte alignment of each tensor (or stacked group) in the buffer: what CUDA's vectorized loads and cuBLAS want."""


@dataclass(frozen=True)
class TensorSlot:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    """Byte offset in the buffer."""

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * self.dtype.itemsize


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def plan_layout(tensors: list[tuple[str, tuple[int, ...], torch.dtype]], groups: list[list[str]]
                ) -> tuple[list[TensorSlot], int]:
    """Where each (name, shape, dtype) goes in the buffer, in order, each aligned to `ALIGNMENT`; the members of a
    group (all present, same dtype and trailing dims) end to end from the first member's place, so the rows of the
    group are one tensor. Returns the slots and the buffer's size."""
    by_name = {name: (tuple(shape), dtype) for name, shape, dtype in tensors}
    group_of = {}
    for group in groups:
        if all(name in by_name for name in group):
            group_of.update({name: group for name in group})
    slots, placed, end = [], set(), 0
    for name, _, _ in tensors:
        if name in placed:
            continue
        offset = -(-end // ALIGNMENT) * ALIGNMENT
        for member in group_of.get(name, [name]):
            shape, dtype = by_name[member]
            slots.append(TensorSlot(member, dtype, shape, offset))
            placed.add(member)
            offset += slots[-1].nbytes
        end = offset
    return slots, end


def slot_view(buffer: torch.Tensor, slot: TensorSlot) -> torch.Tensor:
    """The tensor of `slot` as a view of the flat uint8 `buffer`."""
    return buffer[slot.offset:slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)


class SharedBuffer:
    """The trainer's side: a flat uint8 buffer of `nbytes` on `device` that another process can map."""

    def __init__(self, nbytes: int, device: torch.device):
        self.device = device
        self.nbytes = nbytes
        self.path: Path | None = None
        if device.type == "cuda":
            self.tensor = _ipc_allocation(nbytes, device)
        else:
            folder = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
            self.path = folder / f"tandem-shared-base-{os.getpid()}-{time.monotonic_ns()}"
            storage = torch.UntypedStorage.from_file(str(self.path), shared=True, nbytes=max(nbytes, 1))
            self.tensor = torch.empty(0, dtype=torch.uint8).set_(storage)[:nbytes]
            # The file is the model's size in memory: gone with this object or the process, whatever ends it.
            self._unlink = weakref.finalize(self, self.path.unlink, missing_ok=True)

    def describe(self) -> dict:
        """The `buffer` field of the wire format."""
        if self.path is not None:
            return {"path": str(self.path)}
        from torch.multiprocessing.reductions import reduce_tensor

        torch.cuda.synchronize(self.device)  # the values are written before another process reads them
        rebuild, args = reduce_tensor(self.tensor)
        names = list(inspect.signature(rebuild).parameters)
        return {name: _encode(value) for name, value in zip(names, args)}

    def write(self, run_dir: Path, slots: list[TensorSlot]) -> Path:
        """Publish the buffer and its tensors (`shared_base.json`, tmp + rename)."""
        record = {"pid": os.getpid(), "device": self.device.type, "nbytes": self.nbytes, "buffer": self.describe(),
                  "tensors": [{"name": s.name, "dtype": str(s.dtype).removeprefix("torch."), "shape": list(s.shape),
                               "offset": s.offset} for s in slots]}
        path = shared_base_file(run_dir)
        atomic_write_text(path, json.dumps(record))
        return path

    def remove(self) -> None:
        """Unlink the CPU buffer's file (mappings stay valid); nothing on CUDA."""
        if self.path is not None:
            self._unlink()


def _ipc_allocation(nbytes: int, device: torch.device) -> torch.Tensor:
    """A plain device allocation: CUDA IPC exports `cudaMalloc` memory, and expandable segments (which a shared GPU
    runs with) would need a file descriptor passed between the processes instead, so they are off for this one."""
    # torch's own name for the setter moved (the older one warns where the newer exists): either, as found
    _set_allocator_settings = (getattr(torch._C, "_accelerator_setAllocatorSettings", None)
                               or torch.cuda.memory._set_allocator_settings)
    expandable = "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if expandable:
        _set_allocator_settings("expandable_segments:False")
    try:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    finally:
        if expandable:
            _set_allocator_settings("expandable_segments:True")


def _encode(value):
    if isinstance(value, bytes):
        return {"bytes": base64.b64encode(value).decode()}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, type):
        return {"class": value.__name__}
    if isinstance(value, (tuple, list)):
        return [_encode(v) for v in value]
    return value


def _decode(value):
    if isinstance(value, dict):
        (kind, payload), = value.items()
        return {"bytes": base64.b64decode, "dtype": lambda n: getattr(torch, n), "class": lambda n: getattr(torch, n)}[kind](payload)
    if isinstance(value, list):
        return tuple(_decode(v) for v in value)
    return value


@dataclass
class MappedBase:
    """The engine's side: the trainer's tensors by HF name, views of the mapped buffer."""

    tensors: dict[str, torch.Tensor]
    buffer: torch.Tensor
    pid: int


def read_shared_base(path: Path, device: torch.device) -> MappedBase:
    """Map the buffer that `path` (`shared_base.json`) describes on `device`, which must be the trainer's device type;
    an error names the file where it does not fit."""
    record = json.loads(Path(path).read_text())
    if record["device"] != device.type:
        raise ValueError(f"{path}: the trainer shares its base on {record['device']!r}, this engine runs on "
                         f"{device.type!r}: `lora.share_base` needs trainer and engine on the same device")
    described = record["buffer"]
    if device.type == "cuda":
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        args = {name: _decode(value) for name, value in described.items()}
        args["storage_device"] = device.index if device.index is not None else torch.cuda.current_device()
        buffer = rebuild_cuda_tensor(**args)
    else:
        storage = torch.UntypedStorage.from_file(described["path"], shared=True, nbytes=max(record["nbytes"], 1))
        buffer = torch.empty(0, dtype=torch.uint8).set_(storage)[:record["nbytes"]]
    slots = [TensorSlot(t["name"], getattr(torch, t["dtype"]), tuple(t["shape"]), t["offset"]) for t in record["tensors"]]
    return MappedBase({slot.name: slot_view(buffer, slot) for slot in slots}, buffer, record["pid"])
