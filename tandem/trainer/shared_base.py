"""The trainer's side of `lora.share_base`: its frozen base allocated in one buffer the engine maps.

The frozen parameters get their places in the buffer while still on `meta` (`place_frozen_base`), so the model
is never held twice, not even while it loads: `to_empty_beside` allocates only the rest, and loading writes the
base's values into the buffer. The layout puts each group the engine stacks (q/k/v, gate/up) end to end, so the
trainer's projections are consecutive rows of one tensor, which the engine's fused blocks read as one matrix
(`tandem.transport.shared_base`). Once loaded, the buffer is published (`SharedBase.publish`) and kept alive with
the model, and after the last step the trainer holds it until it is stopped (`hold_for_servers`): on CUDA the
engine's mapping dies with the trainer's process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tandem.models.loading import replace_parameters
from tandem.models.stacked_projections import stacked_groups
from tandem.transport.files import atomic_write_text
from tandem.transport.paths import shared_base_released_file
from tandem.transport.shared_base import SharedBuffer, TensorSlot, plan_layout, slot_view


@dataclass
class SharedBase:
    buffer: SharedBuffer
    slots: list[TensorSlot]

    def publish(self, run_dir: Path) -> Path:
        """Write `shared_base.json` (after the values are loaded): from then on the servers may map it. On CUDA
        the allocator's cache of load-time buffers is released first: an engine starting beside the trainer sizes
        its KV cache from the memory it finds free."""
        if self.buffer.device.type == "cuda":
            torch.cuda.empty_cache()
        return self.buffer.write(run_dir, self.slots)


def place_frozen_base(lm: nn.Module, named_parameters: list[tuple[str, nn.Parameter]], device: torch.device) -> SharedBase:
    """Make each of `named_parameters` (`lm`'s HF-named parameters, every one frozen, still on `meta`) a view of one
    `SharedBuffer` on `device`, in place; returns the buffer and the layout."""
    trainable = [name for name, param in named_parameters if param.requires_grad]
    if trainable:
        raise ValueError(f"`lora.share_base` shares the frozen base, but {trainable[:3]} train: the engine "
                         "would serve stale copies of them; set `lora.share_base` = false")
    tensors = [(name, tuple(param.shape), param.dtype) for name, param in named_parameters]
    slots, nbytes = plan_layout(tensors, stacked_groups(lm))
    buffer = SharedBuffer(nbytes, device)
    replace_parameters(lm, {slot.name: slot_view(buffer.tensor, slot) for slot in slots})
    return SharedBase(buffer, slots)


def to_empty_beside(module: nn.Module, device: torch.device) -> None:
    """`module.to_empty(device)` for the tensors still on `meta`; those already placed (the shared base) stay."""
    module._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)


def hold_for_servers(run_dir: Path, log) -> None:
    """After the last step: say so (`shared_base_released_file`, which the launcher counts as the trainer's end) and
    keep the process, and with it the shared base, alive until a stop signal ends it (`tandem.monitor.stop_signals`)."""
    atomic_write_text(shared_base_released_file(run_dir), "")
    log.info("training done; holding the shared base for the inference servers until the run is stopped")
    while True:
        time.sleep(3600)
