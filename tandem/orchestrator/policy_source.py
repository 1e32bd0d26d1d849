"""Where the orchestrator finds each new policy and how it has the servers load it, per weight transport.

- `FolderPolicies` (filesystem): policy N is ready once `weights/step_N/STABLE` exists; every
  server reloads that folder (`POST /update_weights {"path"}`). A server that missed an update is
  re-admitted by reloading the current folder.
- `BroadcastPolicies` (broadcast): the servers join trainer rank 0's group once (`setup`); policy
  N is ready once the trainer announced it (`broadcasts/step_N.json`), and every server receives it
  while the trainer sends it (vLLM's weight-transfer sequence, the same on both backends). Every
  server takes part in every update, so a server that missed one is re-admitted by taking the next.
  Announcements are loaded in order, never skipped: the trainer's send may return before the
  servers read it (the transport buffers), so two announced policies can be in the group at once,
  and each must be received in turn. Loaded announcements are deleted here, by their consumer.
"""

from __future__ import annotations

import json
from pathlib import Path

from tandem.config.weight_transport import BroadcastWeightTransport, WeightTransportConfig
from tandem.orchestrator.inference_pool import InferencePool
from tandem.transport.paths import announced_steps, broadcast_info_file, latest_stable_step, weights_dir


class FolderPolicies:
    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)

    async def setup(self, pool: InferencePool) -> None:
        """Nothing to set up: folders need no connection."""

    def next_version(self, current: int) -> int | None:
        """The newest published policy, if newer than `current` (older folders need not be loaded)."""
        newest = latest_stable_step(self.run_dir)
        return newest if newest is not None and newest > current else None

    async def load(self, pool: InferencePool, version: int) -> None:
        await pool.update_weights(self._path(version), version)

    async def readmit(self, pool: InferencePool, version: int) -> None:
        await pool.readmit(self._path(version), version)

    def _path(self, version: int) -> str:
        return str(weights_dir(self.run_dir, version).resolve())


class BroadcastPolicies:
    def __init__(self, run_dir: Path, config: BroadcastWeightTransport):
        self.run_dir = Path(run_dir)
        self.config = config

    async def setup(self, pool: InferencePool) -> None:
        """Have every server join the group (returns once the trainer joined too)."""
        ranks_per_server = self.config.num_inference_ranks // pool.num_servers
        await pool.init_weight_transfer([
            {"master_address": self.config.host, "master_port": self.config.port,
             "rank_offset": 1 + i * ranks_per_server, "world_size": self.config.world_size}
            for i in range(pool.num_servers)
        ])

    def next_version(self, current: int) -> int | None:
        """The oldest announced policy newer than `current` (each crosses the group in turn)."""
        return min(announced_steps(self.run_dir, after=current), default=None)

    async def load(self, pool: InferencePool, version: int) -> None:
        update_info = json.loads(broadcast_info_file(self.run_dir, version).read_bytes())
        await pool.broadcast_update(update_info, version)
        for step in announced_steps(self.run_dir, after=-1):
            if step <= version:
                broadcast_info_file(self.run_dir, step).unlink(missing_ok=True)

    async def readmit(self, pool: InferencePool, version: int) -> None:
        """Nothing to do between updates: an excluded server takes part in the next one."""


PolicySource = FolderPolicies | BroadcastPolicies


def setup_policy_source(config: WeightTransportConfig, run_dir: Path) -> PolicySource:
    """The policy source of `weight_transport.type`."""
    if config.type == "filesystem":
        return FolderPolicies(run_dir)
    if config.type == "broadcast":
        return BroadcastPolicies(run_dir, config)
    raise ValueError(f"unknown weight transport type {config.type!r}; known: filesystem, broadcast")
