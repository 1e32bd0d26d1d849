"""How a prefilled prompt's tensors cross from the prefill server holding them to a decode server.

One small interface, the decode server's half: `connect` once per prefill server at start-up, then `receive` the
tensors a `PrefillAnswer` announces. Each backend module also holds the prefill server's half, which
`prefill_api` routes to. Backends: `http_body` (the tensors are a response's body: any two hosts, a copy through
the host's memory), `torch_distributed` (a pair group per decode and prefill server: gloo on the CPU, NCCL between
GPUs, the tensors sent device to device), `shared_memory` (one host: a staging area the decode server maps, CUDA IPC
on GPUs, /dev/shm on the CPU; no byte crosses a socket).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import httpx
import torch

from tandem.inference.disaggregated.wire import PrefillAnswer


class TransferError(RuntimeError):
    """A transfer failed: the decode server prefills the prompt itself."""


class KVTransport(ABC):
    def connect(self, peer: str, timeout_s: float, headers: dict[str, str]) -> None:
        """Ready the transport to the prefill server at `peer` (a base URL, which `headers` let in), at start-up;
        raises TransferError."""

    def is_connected(self, peer: str) -> bool:
        """Whether `connect` holds for `peer` (a failed transfer may have undone it: the caller connects again)."""
        return True

    @abstractmethod
    async def receive(self, client: httpx.AsyncClient, peer: str, answer: PrefillAnswer) -> list[torch.Tensor]:
        """The tensors `answer` announces, taken from `peer`; raises TransferError or httpx.HTTPError."""

    def close(self) -> None:
        """Release what `connect` opened."""
