"""`tandem rl --slurm` and `tandem rl --k8s`: render the run for a cluster instead of running it here.

With `--dry-run` the rendering is printed after the processes' configs; otherwise it is written into the
run folder (`slurm/job.sbatch`, `k8s/manifests.yaml`) and the Slurm script is submitted when `sbatch` exists.
Secrets (`tandem.config.secret`) are never printed; the manifests hold them in a Secret, so their file is
readable by its owner only; the batch script holds the command line, so a secret must not be on it (the nodes
get it from the environment, which Slurm passes on, or from a config file).
"""

from __future__ import annotations

import shutil
import subprocess
import sys

from tandem.config.dump import dump_process_configs
from tandem.config.loader import env_name
from tandem.config.rl import RLConfig
from tandem.config.secret import secrets_of
from tandem.launch.k8s import redacted, render_manifests, to_documents
from tandem.launch.slurm import render_sbatch
from tandem.transport.files import atomic_write_text

FLAGS = {"--slurm": "slurm", "--k8s": "k8s"}
"""Command-line flags of `tandem rl` -> the `deployment.launcher` they select."""


def render(config: RLConfig, argv: list[str], dry_run: bool) -> int:
    """Render (and for Slurm submit) the run; `argv` is the `tandem rl` command line without `--dry-run`."""
    launcher = config.deployment.launcher
    if launcher == "slurm":
        if (flag := _secret_flag(argv, config)) is not None:
            print(f"tandem rl: `{flag}` puts a secret on the command line, which the batch script would hold: set it in "
                  f"the environment ({env_name(flag[2:].replace('-', '_'))}, which sbatch passes to the nodes) or in a "
                  "config file", file=sys.stderr)
            return 2
        text = shown = render_sbatch(config, argv)
    else:
        objects = render_manifests(config)
        text, shown = to_documents(objects), to_documents(redacted(objects))
    if dry_run:
        print(f"{dump_process_configs(config)}\n# ---- {launcher} ----\n{shown}", end="")
        return 0
    path = config.run_dir / ("slurm/job.sbatch" if launcher == "slurm" else "k8s/manifests.yaml")
    path.parent.mkdir(parents=True, exist_ok=True)
    (config.run_dir / "logs").mkdir(parents=True, exist_ok=True)  # Slurm opens the job's output file there first
    atomic_write_text(path, text, mode=0o600 if text != shown else 0o666)
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


def _secret_flag(argv: list[str], config: RLConfig) -> str | None:
    """The flag of the command line `argv` that gives a secret its value (`--key VALUE`, `--key=VALUE`), if one does."""
    values = set(secrets_of(config).values())
    for previous, arg in zip(["", *argv], argv):
        flag, equals, value = arg.partition("=")
        if equals and flag.startswith("--") and value in values:
            return flag
        if arg in values and previous.startswith("--"):
            return previous
    return None
