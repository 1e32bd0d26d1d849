"""The launchers of a multi-node run watch each other through heartbeat files in the shared run folder.

Each launcher writes `nodes/<rendezvous_id>/node_<rank>.json` every second: its host, a beat counter that
grows, and its state (`running`; `finished` once its orchestrator and trainer exited 0, its inference server
still up; `ended`; `failed` with the reason). A peer counts as present once its counter was seen growing, so a
file left by an earlier attempt never passes for a node. Time is measured on the reader's clock only (when it
last saw the counter change), so the nodes' clocks need not agree.

Guarantees: `wait_joined` returns within `join_timeout_s` or raises naming the nodes that never came; `check`
raises naming a node whose counter stopped for `peer_timeout_s` or that reported a failure.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from tandem.launch.process import RunFailed
from tandem.transport.files import atomic_write_text

BEAT_INTERVAL_S = 1.0


def beacon_path(run_dir: Path, rendezvous_id: str, rank: int) -> Path:
    return Path(run_dir) / "nodes" / rendezvous_id / f"node_{rank}.json"


class Beacon:
    """This node's heartbeat: a thread rewriting its file every `BEAT_INTERVAL_S` until `close`."""

    def __init__(self, run_dir: Path, rendezvous_id: str, rank: int, host: str):
        self.path = beacon_path(run_dir, rendezvous_id, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._record = {"rank": rank, "host": host, "beat": 0, "state": "running", "reason": ""}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._write()
        self._thread = threading.Thread(target=self._run, name="node-beacon", daemon=True)
        self._thread.start()

    def set_state(self, state: str, reason: str = "") -> None:
        with self._lock:
            self._record.update(state=state, reason=reason)
        self._write()

    def close(self, state: str, reason: str = "") -> None:
        """Write the final state and stop beating (peers never take an ended node for a lost one)."""
        self._closed.set()
        self._thread.join(timeout=5.0)
        self.set_state(state, reason)

    def _run(self) -> None:
        while not self._closed.wait(BEAT_INTERVAL_S):
            self._write()

    def _write(self) -> None:
        with self._lock:
            self._record["beat"] += 1
            atomic_write_text(self.path, json.dumps(self._record))


@dataclass
class _Seen:
    beat: int | None = None
    changed_at: float = 0.0
    joined: bool = False
    state: str = "missing"
    reason: str = ""


class PeerWatch:
    """What this node knows of the others, from their heartbeat files."""

    def __init__(self, run_dir: Path, rendezvous_id: str, rank: int, hosts: list[str], peer_timeout_s: float):
        self.run_dir, self.rendezvous_id, self.hosts = Path(run_dir), rendezvous_id, hosts
        self.peer_timeout_s = peer_timeout_s
        self.peers = {r: _Seen() for r in range(len(hosts)) if r != rank}

    def name(self, rank: int) -> str:
        return f"node {rank} ({self.hosts[rank]})"

    def poll(self) -> None:
        now = time.monotonic()
        for rank, seen in self.peers.items():
            try:
                record = json.loads(beacon_path(self.run_dir, self.rendezvous_id, rank).read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                continue
            if record["beat"] != seen.beat:
                seen.joined = seen.joined or seen.beat is not None
                seen.beat, seen.changed_at = record["beat"], now
            if seen.joined:
                seen.state, seen.reason = record["state"], record["reason"]

    def wait_joined(self, timeout_s: float) -> None:
        """Return once every peer is beating; RunFailed naming the absent ones after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.poll()
            missing = [r for r, seen in self.peers.items() if not seen.joined]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise RunFailed(f"{', '.join(self.name(r) for r in missing)} did not join within {timeout_s:g} s "
                                f"(`deployment.cluster.join_timeout_s`); is `tandem rl` running there with that "
                                f"`deployment.cluster.node_rank`, and is the run folder shared?")
            time.sleep(BEAT_INTERVAL_S / 2)

    def problem(self) -> str | None:
        """The first peer that failed or was lost, as a sentence; None while all are well."""
        self.poll()
        now = time.monotonic()
        for rank, seen in self.peers.items():
            if seen.state == "failed":
                return f"{self.name(rank)} failed: {seen.reason}"
            if seen.state != "ended" and now - seen.changed_at > self.peer_timeout_s:
                return f"lost {self.name(rank)}: no heartbeat for {self.peer_timeout_s:g} s (`deployment.cluster.peer_timeout_s`)"
        return None

    def check(self) -> None:
        if (problem := self.problem()) is not None:
            raise RunFailed(problem)

    def explain(self, timeout_s: float) -> str | None:
        """After a local failure: wait up to `timeout_s` for a peer's failure or loss that would explain it."""
        deadline = time.monotonic() + timeout_s
        while (problem := self.problem()) is None and time.monotonic() < deadline:
            time.sleep(BEAT_INTERVAL_S / 2)
        return problem

    def all_in(self, states: tuple[str, ...]) -> bool:
        self.poll()
        return all(seen.state in states for seen in self.peers.values())


class Peers(NamedTuple):
    """This node's side of a multi-node run: its own heartbeat and its view of the others."""

    beacon: Beacon
    watch: PeerWatch
