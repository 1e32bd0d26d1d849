"""What crosses between a decode server and a prefill server, each type noting who makes and who reads it."""

from __future__ import annotations

import msgspec
import torch
from pydantic import Field

from tandem.inference.protocol import Body, token_ids


class PrefillRequest(Body):
    """`POST /prefill`: made by a decode server, read by a prefill server."""

    prompt_token_ids: token_ids(1)
    weight_version: int = Field(ge=0)
    """The decode server's policy version: a prefill server holding another refuses (409)."""
    first_block: int = Field(0, ge=0)
    """Leading KV blocks the decode server's prefix cache holds: they are not sent."""


class TensorSpec(msgspec.Struct):
    dtype: str
    """A `torch` dtype name (`float32`, `bfloat16`)."""
    shape: list[int]

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "TensorSpec":
        return cls(str(tensor.dtype).removeprefix("torch."), list(tensor.shape))

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


class PrefillAnswer(msgspec.Struct):
    """The answer to `POST /prefill`: made by a prefill server, read by the decode server, which then takes the
    tensors through its KV transport."""

    transfer_id: str
    """Names the held tensors (`held.HeldPrefills`) until the decode server takes them."""
    weight_version: int
    first_block: int
    tensors: list[TensorSpec]
    """The KV blocks (as the cache exports them: `KVCache.export_blocks`, `LatentCache.export_blocks`), the last
    logits row ([vocab]) and, where the prefill server's speculative draft keeps one, what the decode server's
    needs (`PrefilledPrompt.draft_state`)."""


class PrefillInfo(msgspec.Struct):
    """`GET /prefill/info`: made by a prefill server, checked by a decode server at start-up."""

    model: str
    block_size: int
    cache_layout: str
    """What each KV block holds (`KVCache.layout`, `LatentCache.layout`): blocks move only between equal layouts."""
    weight_version: int


class SendRequest(msgspec.Struct):
    """`POST /kv/{transfer_id}/send` (torch_distributed): which pair group the held tensors go through."""

    pair_id: str


class PairRequest(msgspec.Struct):
    """`POST /kv/pairs` (torch_distributed): a decode server asks for a pair group of its own."""

    pair_id: str


class PairAnswer(msgspec.Struct):
    """The port of the rendezvous store the prefill server opened for the pair (on its own host)."""

    port: int


class AreaRequest(msgspec.Struct):
    """`POST /kv/areas` (shared_memory): a decode server asks for a staging area of its own; asked again with the
    same id (after a failed transfer), the new area replaces the old."""

    area_id: str


class CudaArea(msgspec.Struct):
    """A CUDA allocation another process on the host opens: the fields torch's `reduce_tensor` gives for it."""

    device_uuid: str
    """The GPU it lives on: device indices differ between processes that see different devices."""
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    """torch's count of the processes that map it, which keeps the memory alive in its owner until they unmap it."""
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    offset: int
    """The area's first byte in the storage."""


class AreaAnswer(msgspec.Struct):
    """How a decode server maps its staging area: made by a prefill server."""

    host: str
    """The prefill server's host name: the area can be mapped only there."""
    size: int
    """Bytes: the most one piece of a transfer holds."""
    file_name: str | None = None
    """CPU: the area is `/dev/shm/tandem-kv-<file_name>`."""
    cuda: CudaArea | None = None


class StageRequest(msgspec.Struct):
    """`POST /kv/{transfer_id}/stage` (shared_memory): copy the held tensors' bytes from `start` on into the area
    (as many as it holds); asking it says the decode server copied the previous piece out."""

    area_id: str
    start: int


class StageAnswer(msgspec.Struct):
    length: int
    """Bytes staged, from the area's first: the piece is the transfer's bytes [start, start + length)."""
