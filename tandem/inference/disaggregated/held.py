"""Prompts a prefill server computed, held until their decode server takes them (or gives up on them).

A decode server asks `POST /prefill`, then takes the tensors through its KV transport: in between they wait here,
on the engine's device. One that nobody takes within `disaggregation.hold_timeout_s` (its decode server failed or
timed out and prefilled the prompt itself) is dropped at the next `put`, so the memory comes back.
"""

from __future__ import annotations

import time

import torch

from tandem.inference.serving import random_id


class HeldPrefills:
    def __init__(self, hold_timeout_s: float):
        self.hold_timeout_s = hold_timeout_s
        self._held: dict[str, tuple[float, list[torch.Tensor]]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def put(self, tensors: list[torch.Tensor]) -> str:
        """Hold `tensors`; returns the id that takes them."""
        now = time.monotonic()
        for transfer_id in [t for t, (deadline, _) in self._held.items() if deadline < now]:
            del self._held[transfer_id]
        transfer_id = random_id()
        self._held[transfer_id] = (now + self.hold_timeout_s, tensors)
        return transfer_id

    def take(self, transfer_id: str) -> list[torch.Tensor] | None:
        """The tensors of `transfer_id`, given once; None if unknown or dropped."""
        entry = self._held.pop(transfer_id, None)
        return entry[1] if entry is not None else None
