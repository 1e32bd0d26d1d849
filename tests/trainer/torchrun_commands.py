"""Run under torchrun by the parallelism tests: several `tandem` commands one after another in the same ranks, and
folder copies between them (a checkpoint one command wrote, for the next to resume). Each start of N ranks importing
torch and transformers costs seconds of the CI's 2 cores; one launch pays it once for every command.

    torchrun --nproc-per-node N tests/trainer/torchrun_commands.py '[["trainer", ARG, ...], {"copy": [SRC, DST]}, ...]'

A `{"script": PATH, "argv": [ARG, ...]}` step runs a script's `main(argv)` in the ranks as `python PATH ARG ...` would
(a benchmark whose run opens a trainer session).

Each command gets a process group of its own, joined here under a fresh key prefix of torchrun's store: a command
closes its group at its end (`close_parallel`), and a group made again under the old prefix would meet its peers'
stale addresses. Joined here, the command's `init_parallel` keeps the group and starts no rank watchdog.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from tandem.cli import main as tandem


def join(store: dist.Store, index: int) -> None:
    dist.init_process_group("gloo", store=dist.PrefixStore(f"command_{index}", store), rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))


def script_main(path: str) -> Callable[[list[str]], int]:
    """The `main` of the script at `path`, its folder first on the import path as for `python PATH` (its siblings)."""
    sys.path.insert(0, str(Path(path).parent))
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # where its dataclasses look themselves up
    spec.loader.exec_module(module)
    return module.main


def main(commands: str) -> int:
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=120))
    for index, command in enumerate(json.loads(commands)):
        join(store, index)
        if isinstance(command, dict) and "copy" in command:  # rank 0 copies; the others wait for it before the next command reads it
            if dist.get_rank() == 0:
                shutil.copytree(*command["copy"])
            dist.barrier()
            dist.destroy_process_group()
            continue
        code = script_main(command["script"])(command["argv"]) if isinstance(command, dict) else tandem(command)
        if code:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
