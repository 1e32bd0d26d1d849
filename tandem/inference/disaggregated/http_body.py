"""KV transport through HTTP bodies: the decode server fetches `GET /kv/{transfer_id}` from the prefill server.

The body is the announced tensors' bytes, one after the other, in the order and shapes of `PrefillAnswer.tensors`.
Works between any two hosts; every byte passes through both hosts' memory, so it suits the CPU and tests more than
GPUs. On a GPU the decode server copies the tensors onto its device itself, in a worker thread on a stream of its
own (`kv_transport.CopyStream`): taken into the cache from host memory they would make the engine wait for the copy.
"""

from __future__ import annotations

import asyncio
import math

import httpx
import torch

from tandem.inference.disaggregated.kv_transport import CopyStream, KVTransport, TransferError
from tandem.inference.disaggregated.wire import PrefillAnswer, TensorSpec


def encode(tensors: list[torch.Tensor], copies: CopyStream) -> bytes:
    """The prefill server's half: the tensors' bytes, in order, read to the host on `copies`' stream."""
    with copies.copying():
        return b"".join(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors)


def decode(body: bytes, specs: list[TensorSpec]) -> list[torch.Tensor]:
    """The tensors of `specs` read back from `body`; TransferError if its length is not theirs."""
    sizes = [math.prod(spec.shape) * spec.torch_dtype.itemsize for spec in specs]
    if sum(sizes) != len(body):
        raise TransferError(f"a KV body of {len(body)} bytes, where the announced tensors take {sum(sizes)}")
    flat = torch.frombuffer(bytearray(body), dtype=torch.uint8) if body else torch.empty(0, dtype=torch.uint8)
    tensors = []
    for spec, part in zip(specs, flat.split(sizes)):
        if part.storage_offset() % spec.torch_dtype.itemsize:  # after a tensor of odd size: copy to an aligned start
            part = part.clone()
        tensors.append(part.view(spec.torch_dtype).view(spec.shape))
    return tensors


class HTTPBodyTransport(KVTransport):
    def __init__(self, device: torch.device):
        self._copies = CopyStream(device)

    async def receive(self, client: httpx.AsyncClient, peer: str, answer: PrefillAnswer) -> list[torch.Tensor]:
        response = await client.get(f"{peer}/kv/{answer.transfer_id}")
        response.raise_for_status()
        return await asyncio.to_thread(self._decode, response.content, answer.tensors)  # copies: off the loop

    def _decode(self, body: bytes, specs: list[TensorSpec]) -> list[torch.Tensor]:
        tensors = decode(body, specs)
        with self._copies.copying():
            tensors = [t.to(self._copies.device) for t in tensors]
        self._copies.wait()
        return self._copies.hand_over(tensors)
