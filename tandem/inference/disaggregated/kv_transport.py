"""How a prefilled prompt's tensors cross from the prefill server holding them to a decode server.

One small interface, the decode server's half: `connect` once per prefill server at start-up, then `receive` the
tensors a `PrefillAnswer` announces. Each backend module also holds the prefill server's half, which
`prefill_api` routes to. Backends: `http_body` (the tensors are a response's body: any two hosts, a copy through
the host's memory), `torch_distributed` (a pair group per decode and prefill server: gloo on the CPU, NCCL between
GPUs, the tensors sent device to device), `shared_memory` (one host: a staging area the decode server maps, CUDA IPC
on GPUs, /dev/shm on the CPU; no byte crosses a socket).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod

import httpx
import torch

from tandem.inference.disaggregated.wire import PrefillAnswer


class TransferError(RuntimeError):
    """A transfer failed: the decode server prefills the prompt itself."""


class CopyStream:
    """Where a transport copies KV tensors: on CUDA a stream of its own. A decode server copies received tensors
    onto its device there; a prefill server copies held ones out (staged, encoded, sent), which are whole by then
    (the prefill route waits for `PrefilledPrompt.ready`).

    On the default stream, where the engine runs its steps, a copy would wait for the steps queued before it and
    hold back the ones queued after it (a pageable copy from host memory; on a busy prefill server, each staged
    piece behind the prefill steps queued since its export); on its own stream it overlaps them, and waiting for it
    waits for that copy alone. Tensors made under `copying()` are this stream's allocations: `hand_over` marks them
    as used by the default stream too, where the engine writes them into its cache, so their memory goes to no
    later transfer before the engine has read them."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def copying(self) -> contextlib.AbstractContextManager:
        """Make the enclosed allocations and copies on the copy stream (nothing on the CPU)."""
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def wait(self) -> None:
        """Wait for the copies queued on the copy stream (in a worker thread: the host waits, the engine does not)."""
        if self.stream is not None:
            self.stream.synchronize()

    def hand_over(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.stream is not None:
            for tensor in tensors:
                tensor.record_stream(torch.cuda.default_stream(self.device))
        return tensors


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
