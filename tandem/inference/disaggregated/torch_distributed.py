"""KV transport through torch.distributed: a two-rank group per decode and prefill server, tensors sent device to
device (gloo on the CPU, NCCL between GPUs: the same code).

At start-up the decode server asks `POST /kv/pairs`: the prefill server opens a rendezvous store on a free port and
joins the pair as rank 0 in a thread; the decode server joins as rank 1. Per transfer, the decode server asks
`POST /kv/{transfer_id}/send`, which answers at once (404 for a transfer no longer held) and sends in the
background, and then receives. The decode server runs one transfer per pair at a time: NCCL pairs sends and
receives by order alone. A receive that fails, times out or is given up leaves the pair's order unknown, so the
pair is dropped; the decode server joins a new one with that prefill server before its next prompt there.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import threading
from urllib.parse import urlparse

import httpx
import msgspec
import torch
import torch.distributed as dist

from tandem.inference.disaggregated.kv_transport import CopyStream, KVTransport, TransferError
from tandem.inference.disaggregated.wire import PairAnswer, PairRequest, PrefillAnswer, SendRequest
from tandem.inference.serving import random_id
from tandem.transport.broadcast import bare_group

log = logging.getLogger("tandem.inference")

PREFILL_RANK, DECODE_RANK = 0, 1


class PairGroups:
    """The prefill server's half: its pair group with each decode server, and the sends through them."""

    def __init__(self, device: torch.device, timeout_s: float):
        self.device = device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.groups: dict[str, dist.ProcessGroup] = {}
        self._stores: list[dist.Store] = []
        self._senders: dict[str, threading.Lock] = {}
        self._copies = CopyStream(device)

    def open(self, request: PairRequest) -> PairAnswer:
        """Open the pair's store and join it in a thread (the join returns once the decode server joined too)."""
        store = dist.TCPStore("0.0.0.0", 0, 2, is_master=True, timeout=self.timeout, wait_for_workers=False)
        self._stores.append(store)

        def join() -> None:
            try:
                group = bare_group(dist.PrefixStore(request.pair_id, store), PREFILL_RANK, 2, self.device, self.timeout)
            except RuntimeError:
                log.exception("a decode server did not join KV pair group %s", request.pair_id)
                return
            self._senders[request.pair_id] = threading.Lock()
            self.groups[request.pair_id] = group

        threading.Thread(target=join, name="tandem-kv-pair", daemon=True).start()
        return PairAnswer(store.port)

    def send(self, request: SendRequest, tensors: list[torch.Tensor]) -> None:
        """Send `tensors` to the pair's decode server in a thread; KeyError for an unknown pair."""
        group, lock = self.groups[request.pair_id], self._senders[request.pair_id]

        def send_all() -> None:
            with lock, self._copies.copying():
                try:
                    for tensor in tensors:
                        group.send([tensor.contiguous()], DECODE_RANK, 0).wait(self.timeout)
                except RuntimeError:
                    log.exception("sending KV blocks to pair %s failed", request.pair_id)

        threading.Thread(target=send_all, name="tandem-kv-send", daemon=True).start()

    def close(self) -> None:
        for group in self.groups.values():
            group.shutdown()
        self.groups.clear()


class TorchDistributedTransport(KVTransport):
    """The decode server's half."""

    def __init__(self, device: torch.device, timeout_s: float):
        self.device = device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._pairs: dict[str, tuple[str, dist.ProcessGroup]] = {}
        """Prefill server -> (pair id, group)."""
        self._locks: dict[str, asyncio.Lock] = {}

    def connect(self, peer: str, timeout_s: float, headers: dict[str, str]) -> None:
        pair_id = random_id()
        try:
            response = httpx.post(f"{peer}/kv/pairs", content=msgspec.json.encode(PairRequest(pair_id)),
                                  headers={**headers, "content-type": "application/json"}, timeout=timeout_s)
            response.raise_for_status()
            port = msgspec.json.decode(response.content, type=PairAnswer).port
            store = dist.TCPStore(urlparse(peer).hostname, port, 2, is_master=False, timeout=self.timeout)
            group = bare_group(dist.PrefixStore(pair_id, store), DECODE_RANK, 2, self.device, self.timeout)
        except (httpx.HTTPError, RuntimeError, msgspec.DecodeError) as err:
            raise TransferError(f"could not join a KV pair group with the prefill server {peer}: {err}") from err
        self._pairs[peer] = (pair_id, group)

    def is_connected(self, peer: str) -> bool:
        return peer in self._pairs

    async def receive(self, client: httpx.AsyncClient, peer: str, answer: PrefillAnswer) -> list[torch.Tensor]:
        if peer not in self._pairs:
            raise TransferError(f"no KV pair group with {peer} (never joined, or dropped after a failed transfer)")
        pair_id, group = self._pairs[peer]
        tensors = [torch.empty(spec.shape, dtype=spec.torch_dtype, device=self.device) for spec in answer.tensors]
        async with self._locks.setdefault(peer, asyncio.Lock()):
            response = await client.post(f"{peer}/kv/{answer.transfer_id}/send",
                                         content=msgspec.json.encode(SendRequest(pair_id)),
                                         headers={"content-type": "application/json"})
            response.raise_for_status()
            try:
                await asyncio.to_thread(_receive_all, group, tensors, self.timeout)
            except RuntimeError as err:
                self._pairs.pop(peer, None)
                raise TransferError(f"receiving KV blocks from {peer} failed; its pair group is dropped: {err}") from err
            except BaseException:  # cancelled (the prompt's deadline): the receive goes on in its thread, so the
                self._pairs.pop(peer, None)  # pair's next send would reach it; the pair is not used again
                raise
        return tensors

    def close(self) -> None:
        for _, group in self._pairs.values():
            group.shutdown()
        self._pairs.clear()


def _receive_all(group: dist.ProcessGroup, tensors: list[torch.Tensor], timeout: datetime.timedelta) -> None:
    for tensor in tensors:
        group.recv([tensor], PREFILL_RANK, 0).wait(timeout)
