"""Trainer rank 0's end of the broadcast weight transport (`weight_transport.type = "broadcast"`).

Per published step: write `broadcasts/step_N.json` (the update info, atomically), then send the
tensors over the group. The orchestrator sees the file and has every server receive it with the
same info, so both ends cut the same buckets, then deletes it. The send returns once the group
took the tensors, which may be before the servers read them (the transport buffers): the
orchestrator loads announcements in order, so none is skipped.

The group is torch.distributed's (`tandem.transport.broadcast`) for tandem's servers, vLLM's
own communicator (its trainer-side API, same bucket rule) for vLLM's.

With `weight_transport.quantization = "fp8"` the weights the engine holds in FP8 blocks cross the group
quantized, with their scales (`tandem.models.fp8.quantize_named`), announced as such: the engine copies them in
as they come, which is what it would hold after quantizing the bf16 weights itself.

At start the folder of announcements is emptied before the group forms: the orchestrator reads
announcements only after the group formed, so it never relays one that no trainer will send.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path

import torch

from tandem.config.weight_transport import BroadcastWeightTransport
from tandem.models.fp8 import quantize_named
from tandem.transport.broadcast import SOURCE_RANK, close_group, open_group, send_state
from tandem.transport.broadcast_types import (GroupInitInfo, WeightUpdateInfo, encode_update_info, plan_buckets,
                                              update_info_of)
from tandem.transport.files import atomic_write_bytes
from tandem.transport.paths import broadcast_info_file


class WeightBroadcaster:
    def __init__(self, run_dir: Path, config: BroadcastWeightTransport, device: torch.device,
                 fp8_weights: Collection[str] = ()):
        """`fp8_weights`: the names of the weights the servers hold in FP8 (`tandem.models.fp8.fp8_weight_names`),
        needed where `config.quantization` is "fp8"."""
        if config.quantization == "fp8" and not fp8_weights:
            raise ValueError("`weight_transport.quantization` = 'fp8', but the model has no projections the engine holds "
                             "in FP8 (a model native to tandem, of decoder blocks); set `inference.engine.quantization` "
                             "= 'none'")
        self.run_dir = Path(run_dir)
        self.config = config
        self.device = device
        self.fp8_weights = frozenset(fp8_weights) if config.quantization == "fp8" else frozenset()
        shutil.rmtree(broadcast_info_file(self.run_dir, 0).parent, ignore_errors=True)
        init = GroupInitInfo(config.host, config.port, rank_offset=1, world_size=config.world_size)
        self.group = None
        if config.receiver == "vllm":
            self._send = _vllm_sender(init, device)
        else:
            self.group = open_group(init, SOURCE_RANK, device, config.timeout_s)
            self._send = self._send_over_group

    def send(self, step: int, announced: Mapping[str, torch.Tensor], tensors: Iterable[tuple[str, torch.Tensor]] | None = None) -> int:
        """Announce policy `step` and send it; returns the bytes sent. `announced` gives the tensors' names in
        sending order, with their dtypes and shapes (meta tensors will do); `tensors` yields the (name, tensor) pairs
        in that order, one at a time if it likes (default: `announced`'s own). Both in the trainer's dtype: the
        weights of `fp8_weights` are quantized here, one at a time as they come."""
        if self.fp8_weights:
            announced = dict(quantize_named(announced.items(), self.fp8_weights))
            if tensors is not None:
                tensors = quantize_named(tensors, self.fp8_weights)
        info = update_info_of(announced, self.config.bucket_bytes)
        atomic_write_bytes(broadcast_info_file(self.run_dir, step), encode_update_info(info))
        self._send(announced.items() if tensors is None else tensors, info)
        return sum(bucket.num_bytes for bucket in plan_buckets(info))

    def close(self) -> None:
        if self.group is not None:
            close_group(self.group)
            self.group = None  # the only reference: the group is freed now (see `close_group`)

    def _send_over_group(self, tensors: Iterable[tuple[str, torch.Tensor]], info: WeightUpdateInfo) -> None:
        send_state(self.group, tensors, info, self.device)


def _vllm_sender(init: GroupInitInfo, device: torch.device) -> Callable[[Iterable, WeightUpdateInfo], None]:
    """Send through vLLM's NCCL weight-transfer engine (trainer side), packed as `info` announces."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    # vLLM binds the communicator, and makes its send streams, on the *current* CUDA device
    # (`vllm/distributed/weight_transfer/nccl_common.py`, `trainer_init`): make it `device`.
    with torch.cuda.device(device):
        group = NCCLWeightTransferEngine.trainer_init({"master_address": init.master_address,
                                                       "master_port": init.master_port, "world_size": init.world_size})

    def send(named: Iterable[tuple[str, torch.Tensor]], info: WeightUpdateInfo) -> None:
        tensors = ((name, tensor.to(device)) for name, tensor in named)
        with torch.cuda.device(device):
            NCCLWeightTransferEngine.trainer_send_weights(tensors, {
                "group": group, "packed": True, "packed_buffer_size_bytes": info.packed_buffer_size_bytes})

    return send
