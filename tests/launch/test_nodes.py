"""The launchers' heartbeats: who joined, who failed, who was lost, on the reader's clock only."""

from __future__ import annotations

import json
import time

import pytest

from tandem.launch.nodes import Beacon, PeerWatch, beacon_path
from tandem.launch.process import RunFailed

HOSTS = ["n0", "n1", "n2"]


def write_peer(run_dir, rank: int, beat: int, state: str = "running", reason: str = "") -> None:
    path = beacon_path(run_dir, "attempt", rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rank": rank, "host": HOSTS[rank], "beat": beat, "state": state, "reason": reason}))


def test_a_file_left_by_an_earlier_attempt_is_not_a_node(tmp_path):
    write_peer(tmp_path, 1, 7, state="failed", reason="old")  # never beats again
    write_peer(tmp_path, 2, 1)
    watch = PeerWatch(tmp_path, "attempt", 0, HOSTS, peer_timeout_s=5)
    watch.poll()
    write_peer(tmp_path, 2, 2)
    started = time.monotonic()
    with pytest.raises(RunFailed, match=r"^node 1 \(n1\) did not join within 1.5 s \(`deployment.cluster.join_timeout_s`\)"):
        watch.wait_joined(1.5)
    assert time.monotonic() - started < 3


def test_joined_peers_that_fail_or_go_silent_are_named(tmp_path):
    beacon = Beacon(tmp_path, "attempt", 1, "n1")
    write_peer(tmp_path, 2, 1)
    watch = PeerWatch(tmp_path, "attempt", 0, HOSTS, peer_timeout_s=1.6)  # node 1 beats every second
    watch.poll()
    write_peer(tmp_path, 2, 2)
    watch.wait_joined(5.0)  # node 1 beats by itself; node 2 was seen moving
    assert watch.problem() is None
    time.sleep(1.8)  # node 2 wrote nothing since: lost; node 1 still beats
    assert watch.problem() == "lost node 2 (n2): no heartbeat for 1.6 s (`deployment.cluster.peer_timeout_s`)"
    write_peer(tmp_path, 2, 3, state="ended")
    assert watch.problem() is None and not watch.all_in(("finished", "ended"))
    beacon.set_state("finished")
    assert watch.all_in(("finished", "ended"))
    beacon.close("failed", "the trainer process failed (exit code 1)")
    with pytest.raises(RunFailed, match=r"^node 1 \(n1\) failed: the trainer process failed \(exit code 1\)$"):
        watch.check()
