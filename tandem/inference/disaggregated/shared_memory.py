"""KV transport through memory both servers map, on one host: the bytes never cross a socket.

Each decode server gets a staging area of `disaggregation.staging_mib` in its prefill server: on CUDA device memory
of the prefill server's GPU, which the decode server opens through a CUDA IPC handle (torch's `reduce_tensor` and
`rebuild_cuda_tensor`); on the CPU a file in /dev/shm both map. At start-up the decode server asks `POST /kv/areas`
and maps the area once; it must run on the prefill server's host and see its GPU, else it stops naming the address
or the device. Per transfer it asks `POST /kv/{transfer_id}/stage` for the held tensors' bytes piece by piece (each
piece as much as the area holds, from byte `start` on) and copies each piece out into tensors of its own before
asking the next, holding the area for one transfer at a time; on CUDA on a stream of its own
(`kv_transport.CopyStream`), beside the engine's steps.

Invariants:
- a piece is written over only when the decode server asks for the next one, which it does once it copied the last
  (the request is the acknowledgement), so the area's memory is bounded and reused for every transfer;
- the prefill server lets go of a prompt's held tensors once their last piece is staged;
- the producer keeps the memory alive while the consumer maps it: an area the prefill server replaces or drops
  stays allocated until the decode server's mapping goes too (torch's IPC reference count on CUDA; on the CPU the
  mapping outlives the file, which is unlinked as soon as the decode server has mapped it).
"""

from __future__ import annotations

import asyncio
import mmap
import os
import re
import socket
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from tandem.inference.disaggregated.kv_transport import CopyStream, KVTransport, TransferError
from tandem.inference.disaggregated.wire import AreaAnswer, AreaRequest, CudaArea, PrefillAnswer, StageAnswer, StageRequest
from tandem.inference.serving import random_id

SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
"""Where CPU areas live: memory, not disk, where the system has it."""

AREA_NAME = re.compile(r"[0-9a-f]{32}")
"""A CPU area's file is `tandem-kv-<name>`, the name 32 hex digits: a peer names no other file."""


def area_path(name: str) -> Path:
    return SHM_DIR / f"tandem-kv-{name}"


def byte_views(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's bytes, flat (the tensors must be contiguous): a transfer moves their concatenation."""
    return [t.reshape(-1).view(torch.uint8) for t in tensors]


def pieces(parts: list[torch.Tensor], start: int, length: int) -> list[tuple[torch.Tensor, int]]:
    """The slices of `parts` (byte views) that bytes [start, start + length) of their concatenation cover, each with
    its offset in that window."""
    out, offset = [], 0
    for part in parts:
        lo, hi = max(start, offset), min(start + length, offset + part.numel())
        if lo < hi:
            out.append((part[lo - offset:hi - offset], lo - start))
        offset += part.numel()
    return out


def map_file(path: Path, num_bytes: int) -> torch.Tensor:
    """The first `num_bytes` of the file at `path`, mapped shared (writes reach every process that maps it); an
    OSError if it does not exist (a missing area is never created here)."""
    with open(path, "r+b") as file:
        return torch.frombuffer(mmap.mmap(file.fileno(), num_bytes), dtype=torch.uint8)


def with_index(device: torch.device) -> torch.device:
    """`cuda` as the device it means in this process (`cuda:<current>`): torch's pool calls take only a device with
    an index, and the engine's may have none."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def plain_cuda_bytes(num_bytes: int, device: torch.device) -> tuple[torch.Tensor, torch.cuda.MemPool]:
    """`num_bytes` of device memory in a segment of its own, and the private pool that holds it (kept as long as the
    memory). Another process opens a plain segment by its CUDA IPC handle; a block of an expandable segment (the
    launcher's setting for a shared GPU) is shared through a file descriptor the other process must be allowed to
    take from this one, which containers and ptrace restrictions often forbid. An empty private pool makes a new
    segment, and expandable segments are off while it does."""
    expandable = "expandable_segments:true" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower()
    if expandable:
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")
    try:
        pool = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(pool, device):
            return torch.empty(num_bytes, dtype=torch.uint8, device=device), pool
    finally:
        if expandable:
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")


@dataclass
class Area:
    """The prefill server's side of one decode server's area."""

    memory: torch.Tensor
    """uint8, the area's bytes."""
    path: Path | None
    """CPU: the file, until the decode server has mapped it."""
    pool: torch.cuda.MemPool | None = None
    """CUDA: the private pool of `memory`."""
    transfer_id: str | None = None
    parts: list[torch.Tensor] | None = None
    """The byte views of the transfer being staged."""


class StagingAreas:
    """The prefill server's half: an area per decode server, and the pieces staged into them."""

    def __init__(self, device: torch.device, staging_bytes: int):
        self.device = with_index(device)
        self.staging_bytes = staging_bytes
        self.areas: dict[str, Area] = {}
        self._lock = threading.Lock()
        self._copies = CopyStream(self.device)

    def open(self, request: AreaRequest) -> AreaAnswer:
        """A new area for `request.area_id` (one of the same id, which a decode server asks again after a failed
        transfer, is replaced): how to map it."""
        with self._lock:
            self._drop(request.area_id)
            if self.device.type == "cuda":
                memory, pool = plain_cuda_bytes(self.staging_bytes, self.device)
                _, args = reduce_tensor(memory)
                cuda = CudaArea(device_uuid(self.device), handle=args[7], storage_size_bytes=args[8],
                                storage_offset_bytes=args[9], ref_counter_handle=args[11], ref_counter_offset=args[12],
                                event_handle=args[13], event_sync_required=args[14], offset=args[3])
                self.areas[request.area_id] = Area(memory, None, pool=pool)
                return AreaAnswer(socket.gethostname(), self.staging_bytes, cuda=cuda)
            name = random_id()
            path = area_path(name)
            with open(path, "xb") as file:
                file.truncate(self.staging_bytes)
            self.areas[request.area_id] = Area(map_file(path, self.staging_bytes), path)
            return AreaAnswer(socket.gethostname(), self.staging_bytes, file_name=name)

    def stage(self, request: StageRequest, transfer_id: str, tensors: list[torch.Tensor] | None) -> StageAnswer:
        """Copy the next piece of `transfer_id`'s bytes, from `request.start` on, into the area: `tensors` (the held
        ones) at the first piece, None after. KeyError: no such area; LookupError: not this area's transfer, or a
        start outside it."""
        area = self.areas[request.area_id]
        if area.path is not None:  # the decode server asks only once it mapped the file
            area.path.unlink(missing_ok=True)
            area.path = None
        if tensors is not None:
            with self._copies.copying():  # a copy `contiguous` makes is made where the pieces are copied out
                area.transfer_id, area.parts = transfer_id, byte_views([t.contiguous() for t in tensors])
        elif area.transfer_id != transfer_id:
            raise LookupError(f"transfer {transfer_id!r} is not being staged in area {request.area_id!r}")
        total = sum(part.numel() for part in area.parts)
        if not 0 <= request.start < total:
            raise LookupError(f"byte {request.start} is outside transfer {transfer_id!r} of {total} bytes")
        length = min(self.staging_bytes, total - request.start)
        with self._copies.copying():
            for part, offset in pieces(area.parts, request.start, length):
                area.memory[offset:offset + part.numel()].copy_(part)
        self._copies.wait()  # the decode server reads the area next
        if request.start + length >= total:
            area.transfer_id = area.parts = None
        return StageAnswer(length)

    def drop(self, area_id: str) -> None:
        with self._lock:
            self._drop(area_id)

    def _drop(self, area_id: str) -> None:
        area = self.areas.pop(area_id, None)
        if area is not None and area.path is not None:
            area.path.unlink(missing_ok=True)

    def close(self) -> None:
        for area_id in list(self.areas):
            self.drop(area_id)


class SharedMemoryTransport(KVTransport):
    """The decode server's half."""

    def __init__(self, device: torch.device):
        self.device = with_index(device)
        self._copies = CopyStream(self.device)
        self._areas: dict[str, torch.Tensor] = {}
        """Prefill server -> its area, mapped here."""
        self._area_ids: dict[str, str] = {}
        """Prefill server -> this server's area id there, kept across failures so that a new area replaces the old."""
        self._locks: dict[str, asyncio.Lock] = {}
        self._headers: dict[str, str] = {}

    def connect(self, peer: str, timeout_s: float, headers: dict[str, str]) -> None:
        self._headers = headers
        area_id = self._area_ids.setdefault(peer, random_id())
        try:
            response = httpx.post(f"{peer}/kv/areas", content=msgspec.json.encode(AreaRequest(area_id)),
                                  headers={**headers, "content-type": "application/json"}, timeout=timeout_s)
            response.raise_for_status()
            answer = msgspec.json.decode(response.content, type=AreaAnswer)
        except (httpx.HTTPError, msgspec.DecodeError) as err:
            raise TransferError(f"could not get a KV staging area from the prefill server {peer}: {err}") from err
        if answer.host != socket.gethostname():
            raise TransferError(f"the prefill server {peer} runs on host {answer.host!r}, this decode server on "
                                f"{socket.gethostname()!r}: `disaggregation.kv_transport` = 'shared_memory' needs both "
                                "on one host")
        self._areas[peer] = self._map(peer, answer)

    def _map(self, peer: str, answer: AreaAnswer) -> torch.Tensor:
        if answer.cuda is None:
            if answer.file_name is None or not AREA_NAME.fullmatch(answer.file_name):
                raise TransferError(f"the prefill server {peer} named no staging file of its own: {answer.file_name!r}")
            path = area_path(answer.file_name)
            try:
                return map_file(path, answer.size)
            except OSError as err:
                raise TransferError(f"cannot map the prefill server {peer}'s KV staging area {path}: {err}") from err
        cuda = answer.cuda
        here = [i for i in range(torch.cuda.device_count()) if device_uuid(torch.device("cuda", i)) == cuda.device_uuid]
        if not here:
            raise TransferError(f"the prefill server {peer} stages KV blocks on GPU {cuda.device_uuid}, which this "
                                "decode server does not see (`CUDA_VISIBLE_DEVICES`)")
        try:
            return rebuild_cuda_tensor(torch.Tensor, (answer.size,), (1,), cuda.offset, torch.UntypedStorage,
                                       torch.uint8, here[0], cuda.handle, cuda.storage_size_bytes,
                                       cuda.storage_offset_bytes, False, cuda.ref_counter_handle,
                                       cuda.ref_counter_offset, cuda.event_handle, cuda.event_sync_required)
        except RuntimeError as err:
            raise TransferError(f"cannot open the prefill server {peer}'s KV staging area on GPU {cuda.device_uuid} "
                                f"(cuda:{here[0]} here) through CUDA IPC: {err}") from err

    def is_connected(self, peer: str) -> bool:
        return peer in self._areas

    async def receive(self, client: httpx.AsyncClient, peer: str, answer: PrefillAnswer) -> list[torch.Tensor]:
        if peer not in self._areas:
            raise TransferError(f"no KV staging area mapped from {peer} (never mapped, or dropped after a failure)")
        area = self._areas[peer]
        with self._copies.copying():
            tensors = [torch.empty(spec.shape, dtype=spec.torch_dtype, device=self.device) for spec in answer.tensors]
        parts = byte_views(tensors)
        total, start = sum(part.numel() for part in parts), 0
        async with self._locks.setdefault(peer, asyncio.Lock()):
            try:
                while start < total:
                    response = await client.post(f"{peer}/kv/{answer.transfer_id}/stage", content=msgspec.json.encode(
                        StageRequest(self._area_ids[peer], start)), headers={"content-type": "application/json"})
                    response.raise_for_status()
                    length = msgspec.json.decode(response.content, type=StageAnswer).length
                    if length <= 0:
                        raise TransferError(f"the prefill server {peer} staged {length} bytes of a transfer of {total}")
                    await asyncio.to_thread(self._copy_out, area, parts, start, length)
                    start += length
            except BaseException:  # the area's state there is unknown: the next prompt asks for a new one
                self._areas.pop(peer, None)
                raise
        return self._copies.hand_over(tensors)

    def _copy_out(self, area: torch.Tensor, parts: list[torch.Tensor], start: int, length: int) -> None:
        with self._copies.copying():
            for part, offset in pieces(parts, start, length):
                part.copy_(area[offset:offset + part.numel()])
        self._copies.wait()  # the prefill server writes the next piece over the area once asked for it

    def close(self) -> None:
        """Unmap the areas and have each prefill server free its own (at most a second each: a prefill server that
        is gone freed it already)."""
        self._areas.clear()
        for peer, area_id in self._area_ids.items():
            try:
                httpx.delete(f"{peer}/kv/areas/{area_id}", headers=self._headers, timeout=1.0)
            except httpx.HTTPError:
                pass
