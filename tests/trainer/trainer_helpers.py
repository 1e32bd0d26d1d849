"""Helpers of the trainer tests: run the trainer in-process, read metrics, write rollout files.

`run_trainer` runs the real `tandem trainer` entry point in this process (world size 1, an
in-process process group): the same code path as the command, without paying a Python start.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch

from tandem.config.loader import parse_args
from tandem.config.trainer import TrainerConfig
from tandem.transport.files import atomic_write_bytes
from tandem.transport.paths import rollout_file
from tandem.transport.types import PackedRow, TrainingBatch, encode_batch


@contextmanager
def one_thread():
    """This process at one torch thread while torchrun's ranks (one thread each) run beside it: otherwise the
    threads of three processes outnumber CI's two cores, and every small op of the in-process run waits for one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run_trainer(*args: str) -> int:
    """`tandem trainer ARGS` on the CPU (the tests' numbers are fp32 CPU numbers, also on a GPU host)."""
    from tandem.trainer.rl.train import main

    return main(parse_args(TrainerConfig, ["--device", "cpu", *args], environ={}))


def losses(run_dir: Path, process: str = "trainer") -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["process"] == process}


def metrics(run_dir: Path, process: str = "trainer") -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["process"] == process]


def write_rollouts(run_dir: Path, step: int, rows: list[PackedRow], rank: int = 0, num_loss_tokens: int | None = None) -> None:
    """Write one rank's batch file as the orchestrator does (atomically)."""
    n = sum(sum(r.loss_mask) for r in rows) if num_loss_tokens is None else num_loss_tokens
    batch = TrainingBatch(step=step, rank=rank, rows=rows, num_loss_tokens=n)
    atomic_write_bytes(rollout_file(run_dir, step, rank), encode_batch(batch))


def random_row(gen: torch.Generator, samples: list[tuple[int, int]], vocab: int = 260, advantage_scale: float = 1.0) -> PackedRow:
    """A packed row of (prompt_len, completion_len) samples with plausible inference logprobs."""
    ids, pos, mask, lps, adv, temps = [], [], [], [], [], []
    for prompt, completion in samples:
        n = prompt + completion
        ids += torch.randint(0, vocab, (n,), generator=gen).tolist()
        pos += list(range(n))
        mask += [0] * prompt + [1] * completion
        a = float(torch.randn((), generator=gen)) * advantage_scale
        lps += [0.0] * prompt + (-5.5 + 0.3 * torch.randn(completion, generator=gen)).tolist()
        adv += [0.0] * prompt + [a] * completion
        temps += [1.0] * prompt + [0.7] * completion
    return PackedRow(ids, pos, mask, lps, adv, temps)
