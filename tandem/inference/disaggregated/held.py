"""Prompts a prefill server computed, held until their decode server takes them (or gives up on them).

A decode server asks `POST /prefill`, then takes the tensors through its KV transport: in between they wait here,
on the engine's device. One that nobody takes within `disaggregation.hold_timeout_s` (its decode server failed or
timed out and prefilled the prompt itself) is dropped at the next `put` or `reserve`, so the memory comes back.

Nothing but the arrival rate bounds how many prompts wait: a decode server takes one at a time from each prefill
server, while the engine computes them in batches, so when prompts come faster than they are taken the exports pile
up beside the cache. Their bytes are therefore bounded (`disaggregation.max_held_mib`): a prompt is admitted only
if its estimated export fits beside what is held and what prompts being computed reserved. Over the budget a new
prompt is refused for now (429), rather than an old held one dropped: its decode server asks again after a pause
(`tandem.inference.disaggregated.peers`), so the prefill pool's pace paces the hand-offs and the decoding
sequences never wait on a long prompt computed beside them; dropping a held one would waste its computed prompt. A
prompt whose export alone passes the budget can never be admitted: refused at once (400), its decode server
prefills it itself.

Invariant: `num_bytes` = the bytes of the held tensors + the reservations of prompts being computed, at most
`max_bytes` whenever a `reserve` admits. A taken prompt's tensors leave the count at once, though a transport may
still read them (one transfer at a time per decode server).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from tandem.inference.serving import random_id


class OverBudget(RuntimeError):
    """The prompt's export would take the held bytes past `disaggregation.max_held_mib` for now."""


class LargerThanBudget(ValueError):
    """The prompt's export alone passes `disaggregation.max_held_mib`: no wait admits it."""


class HeldPrefills:
    def __init__(self, hold_timeout_s: float, max_bytes: int):
        self.hold_timeout_s = hold_timeout_s
        self.max_bytes = max_bytes
        self._held: dict[str, tuple[float, list[torch.Tensor]]] = {}
        self._held_bytes = 0
        self._reserved_bytes = 0

    def __len__(self) -> int:
        return len(self._held)

    @property
    def num_bytes(self) -> int:
        """Held tensors' bytes and those reserved by prompts being computed."""
        return self._held_bytes + self._reserved_bytes

    @contextlib.contextmanager
    def reserve(self, num_bytes: int) -> Iterator[None]:
        """Room for a prompt whose export takes about `num_bytes`, while it is computed (its `put` holds the real
        bytes); before any work, LargerThanBudget if `num_bytes` alone passes `max_bytes`, OverBudget if it would
        with what is held and reserved now."""
        if num_bytes > self.max_bytes:
            raise LargerThanBudget(f"this prompt's KV takes {num_bytes / 2**20:.1f} MiB, more than "
                                   f"`disaggregation.max_held_mib` ({self.max_bytes / 2**20:.1f} MiB) lets this "
                                   "prefill server hold")
        self._drop_expired()
        if self.num_bytes + num_bytes > self.max_bytes:
            raise OverBudget(f"this prefill server holds {self.num_bytes / 2**20:.1f} MiB of prompts not yet taken "
                             f"or being computed; this one's {num_bytes / 2**20:.1f} MiB would pass "
                             f"`disaggregation.max_held_mib` ({self.max_bytes / 2**20:.1f} MiB)")
        self._reserved_bytes += num_bytes
        try:
            yield
        finally:
            self._reserved_bytes -= num_bytes

    def put(self, tensors: list[torch.Tensor]) -> str:
        """Hold `tensors`; returns the id that takes them."""
        self._drop_expired()
        transfer_id = random_id()
        self._held[transfer_id] = (time.monotonic() + self.hold_timeout_s, tensors)
        self._held_bytes += _nbytes(tensors)
        return transfer_id

    def take(self, transfer_id: str) -> list[torch.Tensor] | None:
        """The tensors of `transfer_id`, given once; None if unknown or dropped."""
        entry = self._held.pop(transfer_id, None)
        if entry is None:
            return None
        self._held_bytes -= _nbytes(entry[1])
        return entry[1]

    def _drop_expired(self) -> None:
        now = time.monotonic()
        for transfer_id in [t for t, (deadline, _) in self._held.items() if deadline < now]:
            self.take(transfer_id)


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.nbytes for t in tensors)
