"""`tandem rl --slurm`: one sbatch job whose single `srun` step runs `tandem rl` once on every node.

Each task is one node's launcher: it resolves the same command line with the allocation's host names and
its `SLURM_NODEID` as `deployment.cluster.node_rank`, so every process finds its peers in its resolved
config, then starts the processes of its node (`ClusterConfig.roles`). Failure ends everything: a launcher
that fails exits non-zero, `--kill-on-bad-exit` makes Slurm kill the other tasks, `--wait` bounds how long
the others may outlive the first task to end, and the batch script ends with its step, so the allocation
is released whether the run failed or finished; `#SBATCH --time` bounds the rest.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from tandem.config.rl import RLConfig


def render_sbatch(config: RLConfig, argv: list[str]) -> str:
    """The batch script of the run; `argv` is the `tandem rl` command line the nodes re-resolve, from the
    directory it ran in and with the same Python (both must be on the nodes' shared file system)."""
    deployment, slurm = config.deployment, config.deployment.slurm
    cluster = deployment.cluster
    n = cluster.num_nodes
    workdir = Path.cwd().resolve()
    run_dir = (workdir / config.run_dir).resolve()
    directives = [f"--job-name={shlex.quote('tandem-' + config.run.name)}", f"--nodes={n}", "--ntasks-per-node=1",
                  f"--time={slurm.time_limit}", f"--chdir={shlex.quote(str(workdir))}",
                  f"--output={shlex.quote(str(run_dir / 'logs' / 'slurm-%j.out'))}"]
    if slurm.partition:
        directives.append(f"--partition={shlex.quote(slurm.partition)}")
    if slurm.account:
        directives.append(f"--account={shlex.quote(slurm.account)}")
    if deployment.type == "gpu":
        directives.append(f"--gpus-per-node={max(deployment.inference_devices + deployment.trainer_devices) + 1}")
    node_argv = [sys.executable, "-m", "tandem.cli", "rl", *argv, "--deployment.launcher", "local"]
    wait_s = int(2 * cluster.peer_timeout_s + 60)
    lines = [
        "#!/bin/bash",
        *(f"#SBATCH {d}" for d in directives),
        f"# Rendered by `tandem rl --slurm` for run {config.run.name!r}: {n} node(s), one launcher each.",
        "set -euo pipefail",
        "",
        *slurm.setup,
        "# The allocation's hosts in node order, as a TOML list: node i of the run is SLURM_NODEID i.",
        'mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        'hosts="[$(printf \'"%s",\' "${nodes[@]}")]"',
        "",
        "# One task per node. A task that fails kills the others (--kill-on-bad-exit); once one task ends the",
        f"# others get {wait_s} s (--wait); the job, and its nodes, end with this step.",
        "# shellcheck disable=SC2016  # $@ and SLURM_NODEID are expanded by each task's bash, on its node",
        f"srun --nodes={n} --ntasks={n} --ntasks-per-node=1 --kill-on-bad-exit=1 --wait={wait_s} \\",
        "  bash -c 'exec \"$@\" --deployment.cluster.node-rank \"$SLURM_NODEID\"' node \\",
        f"  {shlex.join(node_argv)} \\",
        '  --deployment.cluster.hosts "$hosts" --deployment.cluster.rendezvous-id "slurm-$SLURM_JOB_ID"',
    ]
    return "\n".join(lines) + "\n"
