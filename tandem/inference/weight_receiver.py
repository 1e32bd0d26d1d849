"""A server's end of the broadcast weight transport: join the group once, then receive updates.

The route sequence is vLLM's weight-transfer protocol (`docs/weight_transport.md`): `init` once,
then per policy `start` -> `receive` (the trainer sends at the same time) -> `finish`, which
applies the received tensors exactly as a folder reload does (`LLMEngine.update_weights`: every
name and shape checked before the first copy, then the version bump). Out-of-order calls are
`ConflictError`s. A receive always consumes the whole broadcast, even if the tensors then do not fit
the model, so the group stays in step for the next update.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from tandem.transport.broadcast import close_group, open_group, receive_state
from tandem.transport.broadcast_types import GroupInitInfo, WeightUpdateInfo


class ConflictError(Exception):
    """A weight-transfer call came out of order (a 409)."""


class WeightReceiver:
    def __init__(self, device: torch.device, timeout_s: float):
        self.device = device if device.type == "cuda" else torch.device("cpu")
        self.timeout_s = timeout_s
        self.group: dist.ProcessGroup | None = None
        self.is_updating = False
        self.received: dict[str, torch.Tensor] | None = None
        self._lock = threading.Lock()

    def join(self, init: GroupInitInfo) -> None:
        """Blocking: returns once the whole group formed."""
        with self._lock:
            if self.group is not None:
                raise ConflictError("this server already joined a weight-transfer group")
            if not 0 < init.rank_offset < init.world_size:
                raise ValueError(f"`init_info.rank_offset` = {init.rank_offset} must be in 1..world_size-1 "
                                 f"(world_size = {init.world_size}; rank 0 is the trainer)")
            self.group = open_group(init, init.rank_offset, self.device, self.timeout_s)

    def close(self) -> None:
        """Leave the group (at server shutdown)."""
        if self.group is not None:
            close_group(self.group)
            self.group = None

    def start(self) -> None:
        if self.group is None:
            raise ConflictError("no weight-transfer group: call /init_weight_transfer_engine first")
        if self.is_updating:
            raise ConflictError("a weight update is already open: finish it with /finish_weight_update")
        self.is_updating, self.received = True, None

    def receive(self, info: WeightUpdateInfo) -> None:
        """Blocking: receive the tensors `info` announces (kept until `finish`)."""
        if not self.is_updating:
            raise ConflictError("no weight update is open: call /start_weight_update first")
        info.check()
        self.received = receive_state(self.group, info, self.device)

    def finish(self) -> dict[str, torch.Tensor]:
        """Close the update; returns what it received (for the engine to apply)."""
        if not self.is_updating:
            raise ConflictError("no weight update is open: call /start_weight_update first")
        received, self.received, self.is_updating = self.received, None, False
        if received is None:
            raise ConflictError("the update received no weights: call /update_weights with `update_info` before finishing")
        return received
