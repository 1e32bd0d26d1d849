"""The trainer's command line: one process, torchrun on this machine, or torchrun joined across nodes."""

from __future__ import annotations

import sys

from tandem.config.resolve import free_port
from tandem.config.deployment import DeploymentConfig


def trainer_argv(deployment: DeploymentConfig, config_path: str, rendezvous_host: str, is_host: str | None,
                 python: str = sys.executable, command: str = "trainer") -> list[str]:
    """The command that runs this node's trainer ranks.

    Several nodes meet in torchrun's c10d rendezvous on `rendezvous_host` (the first node): `is_host` says
    which agent serves its store (`"1"`, `"0"`, or shell text that expands to one; None: torchrun compares the
    host name with its own), `command` is `trainer` or `trainer-preflight`, `join_timeout` bounds
    the wait for the others, and no restarts: a lost rank ends the run, the launchers say which node went."""
    trainer = ["-m", "tandem.cli", command, "@", config_path]
    cluster = deployment.cluster
    if cluster.num_trainer_nodes == 1 and deployment.ranks_per_node == 1:
        return [python, *trainer]
    torchrun = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(deployment.ranks_per_node)]
    if cluster.num_trainer_nodes == 1:
        return [*torchrun, "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *trainer]
    conf = f"join_timeout={cluster.join_timeout_s:.0f}"
    if is_host is not None:
        conf += f",is_host={is_host}"
    return [*torchrun, "--nnodes", str(cluster.num_trainer_nodes), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{rendezvous_host}:{cluster.rendezvous_port}", "--rdzv-id", cluster.rendezvous_id,
            "--rdzv-conf", conf, "--max-restarts", "0", *trainer]
