"""What a benchmark result was measured with: library versions, the device, and the code's commit.

The commit comes from git unless `--commit` names it: a machine that runs a copy of the tree
(the GPU machine of the device tool) may hold a stale `.git`, and the result must name the code
that ran.
"""

from __future__ import annotations

import subprocess

import torch


def source_commit(given: str | None = None) -> str:
    """`given`, else git's HEAD, marked when tracked files differ from it."""
    if given:
        return given
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True).stdout
    except OSError:
        return "unknown"
    return (commit or "unknown") + (" + uncommitted changes" if changed.strip() else "")


def environment(device: torch.device, commit: str | None = None) -> dict:
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "commit": source_commit(commit),
           "device": str(device)}
    if device.type == "cuda":
        env |= {"gpu": torch.cuda.get_device_name(device), "cudnn": torch.backends.cudnn.version()}
    return env
