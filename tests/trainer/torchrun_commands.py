"""Run under torchrun by the parallelism tests: several `tandem` commands one after another in the same ranks, and
folder copies between them (a checkpoint one command wrote, for the next to resume). Each start of N ranks importing
torch and transformers costs seconds of the CI's 2 cores; one launch pays it once for every command.

    torchrun --nproc-per-node N tests/trainer/torchrun_commands.py '[["trainer", ARG, ...], {"copy": [SRC, DST]}, ...]'

Each command gets a process group of its own, joined here under a fresh key prefix of torchrun's store: a command
closes its group at its end (`close_parallel`), and a group made again under the old prefix would meet its peers'
stale addresses. Joined here, the command's `init_parallel` keeps the group and starts no rank watchdog.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from datetime import timedelta

import torch.distributed as dist

from tandem.cli import main as tandem


def join(store: dist.Store, index: int) -> None:
    dist.init_process_group("gloo", store=dist.PrefixStore(f"command_{index}", store), rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))


def main(commands: str) -> int:
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=120))
    for index, command in enumerate(json.loads(commands)):
        join(store, index)
        if isinstance(command, dict):  # rank 0 copies; the others wait for it before the next command reads it
            if dist.get_rank() == 0:
                shutil.copytree(*command["copy"])
            dist.barrier()
            dist.destroy_process_group()
            continue
        code = tandem(command)
        if code:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
