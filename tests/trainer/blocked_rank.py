"""Run under torchrun by `test_rank_watchdog.py`: two trainer ranks stuck the way a run's ranks get stuck when a
peer is lost: each waits in gloo for a message the other never sends, under the clean-stop handler of SIGTERM,
which cannot run there. Each writes its pid to `FOLDER/rank_R.pid` once it is about to wait.

    torchrun --nproc-per-node 2 tests/trainer/blocked_rank.py FOLDER
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tandem.monitor.logging import setup_logging
from tandem.monitor.stop_signals import stopping_on_signals
from tandem.trainer.parallel.dims import init_parallel


def say_here(folder: Path, rank: int) -> None:
    tmp = folder / f"rank_{rank}.pid.tmp"
    tmp.write_text(str(os.getpid()))
    tmp.rename(folder / f"rank_{rank}.pid")


def main(folder: Path) -> None:
    setup_logging("trainer")
    rank = init_parallel("cpu").rank
    with stopping_on_signals():
        say_here(folder, rank)
        dist.recv(torch.zeros(1), src=1 - rank)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
