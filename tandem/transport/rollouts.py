"""Rollout transports: how the orchestrator's `TrainingBatch`es reach the trainer ranks.

`RolloutSender` is the orchestrator side. The filesystem backend writes one msgpack file per
rank and step (`paths.rollout_file`), each atomically (tmp + rename), so a trainer rank that
sees its file sees all of it. The trainer reads `rank_R.msgpack` of step N with
`tandem.transport.types.decode_batch`. A ZMQ backend can implement the same base class later.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

from tandem.transport.files import atomic_write_bytes
from tandem.transport.paths import rollout_file
from tandem.transport.types import TrainingBatch, encode_batch


class RolloutSender(ABC):
    """Ships the batches of one step, one per trainer rank."""

    @abstractmethod
    def send(self, step: int, batches: list[TrainingBatch]) -> None:
        """Deliver `batches[r]` to trainer rank r; returns once every rank can read its batch."""


class FilesystemRolloutSender(RolloutSender):
    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)

    def send(self, step: int, batches: list[TrainingBatch]) -> None:
        for rank, batch in enumerate(batches):
            if batch.step != step or batch.rank != rank:
                raise ValueError(f"batch for step {batch.step} rank {batch.rank} sent as step {step} rank {rank}")
            atomic_write_bytes(rollout_file(self.run_dir, step, rank), encode_batch(batch))


def setup_rollout_sender(transport_type: str, run_dir: Path) -> RolloutSender:
    """The sender of `transport.type`."""
    if transport_type == "filesystem":
        return FilesystemRolloutSender(run_dir)
    raise ValueError(f"unknown rollout transport type {transport_type!r}; known: filesystem")
