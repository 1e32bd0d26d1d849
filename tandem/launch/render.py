"""`tandem rl --slurm` and `tandem rl --k8s`: render the run for a cluster instead of running it here.

With `--dry-run` the rendering is printed after the processes' configs; otherwise it is written into the
run folder (`slurm/job.sbatch`, `k8s/manifests.yaml`) and the Slurm script is submitted when `sbatch` exists.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

from tandem.config.dump import dump_process_configs
from tandem.config.rl import RLConfig
from tandem.launch.k8s import render_manifests, to_documents
from tandem.launch.slurm import render_sbatch
from tandem.transport.files import atomic_write_text

FLAGS = {"--slurm": "slurm", "--k8s": "k8s"}
"""Command-line flags of `tandem rl` -> the `deployment.launcher` they select."""


def render(config: RLConfig, argv: list[str], dry_run: bool) -> int:
    """Render (and for Slurm submit) the run; `argv` is the `tandem rl` command line without `--dry-run`."""
    launcher = config.deployment.launcher
    text = render_sbatch(config, argv) if launcher == "slurm" else to_documents(render_manifests(config))
    if dry_run:
        print(f"{dump_process_configs(config)}\n# ---- {launcher} ----\n{text}", end="")
        return 0
    path = config.run_dir / ("slurm/job.sbatch" if launcher == "slurm" else "k8s/manifests.yaml")
    path.parent.mkdir(parents=True, exist_ok=True)
    (config.run_dir / "logs").mkdir(parents=True, exist_ok=True)  # Slurm opens the job's output file there first
    atomic_write_text(path, text)
    if launcher == "k8s":
        print(f"tandem rl: wrote {path}; start the run with `kubectl apply -f {path}`, remove it with `kubectl delete -f {path}`")
        return 0
    if shutil.which("sbatch") is None:
        print(f"tandem rl: wrote {path}; `sbatch` is not on PATH: submit it from a Slurm login node with `sbatch {path}`")
        return 0
    submitted = subprocess.run(["sbatch", str(path)], capture_output=True, text=True)
    print(submitted.stdout, end="")
    print(submitted.stderr, end="", file=sys.stderr)
    if submitted.returncode != 0:
        print(f"tandem rl: sbatch {path} failed (exit code {submitted.returncode})", file=sys.stderr)
    return submitted.returncode
