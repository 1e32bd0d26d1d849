"""Trainer rank 0's end of the broadcast weight transport (`weight_transport.type = "broadcast"`).

Per published step: write `broadcasts/step_N.json` (the update info, atomically), then send the
tensors over the group. The orchestrator sees the file and has every server receive it with the
same info, so both ends cut the same buckets. The send returns once the group took the tensors:
the trainer runs at most one policy ahead of the servers' updates, never more.

At start the folder of announcements is emptied before the group forms: the orchestrator reads
announcements only after the group formed, so it never relays one that no trainer will send.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from tandem.config.weight_transport import BroadcastWeightTransport
from tandem.transport.broadcast import SOURCE_RANK, open_group, send_state
from tandem.transport.broadcast_types import GroupInitInfo, encode_update_info, update_info_of
from tandem.transport.files import atomic_write_bytes
from tandem.transport.paths import broadcast_info_file


class WeightBroadcaster:
    def __init__(self, run_dir: Path, config: BroadcastWeightTransport, device: torch.device):
        self.run_dir = Path(run_dir)
        self.config = config
        self.device = device
        shutil.rmtree(broadcast_info_file(self.run_dir, 0).parent, ignore_errors=True)
        init = GroupInitInfo(config.host, config.port, rank_offset=1, world_size=config.world_size)
        self.group = open_group(init, SOURCE_RANK, device, config.timeout_s)

    def send(self, step: int, state: dict[str, torch.Tensor]) -> None:
        info = update_info_of(state, self.config.bucket_bytes)
        atomic_write_bytes(broadcast_info_file(self.run_dir, step), encode_update_info(info))
        send_state(self.group, state, info, self.device)
        broadcast_info_file(self.run_dir, step - 2).unlink(missing_ok=True)  # the servers hold step - 1 or newer
