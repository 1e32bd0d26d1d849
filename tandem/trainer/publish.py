"""Publish a policy as `weights/step_N/`: HF-named safetensors, config, tokenizer, then `STABLE`.

Order matters to the readers (orchestrator, inference server): `STABLE` is written last, after
every other file is complete (each written tmp + rename), and it is removed first when a folder is
rewritten (after a resume) or deleted, so a folder with `STABLE` is always whole. Old folders are
pruned to the newest `keep`, never fewer than 2: the orchestrator may still be loading the
previous policy while the trainer publishes the next one.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
from pathlib import Path
from typing import Callable

import torch

from tandem.models.lora import LoraSpec, write_adapter_folder
from tandem.models.weights import save_state_dict, side_files, unquantized_side_file
from tandem.transport.files import atomic_write_bytes, atomic_write_text
from tandem.transport.paths import STABLE, final_weights_dir, weights_dir

def published_dtype(hf_config: dict) -> torch.dtype:
    """Weights are published in the dtype of the model folder they started from."""
    name = hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32"
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(str(name), torch.float32)


def write_weights_folder(run_dir: Path, step: int, state: dict[str, torch.Tensor], model_folder: Path, hf_config: dict,
                         lora: LoraSpec | None = None, base_model: str = "") -> Path:
    """Write `weights/step_N/` in the order readers rely on (`hf_config`: the model's config.json,
    which says the on-disk layout); returns the folder. With `lora`, `state` holds the adapters, written as a PEFT
    adapter folder of `base_model` (the name the run loaded its base by)."""
    folder = weights_dir(run_dir, step)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / STABLE).unlink(missing_ok=True)
    if lora is not None:
        write_adapter_folder(folder, state, lora, base_model)
    else:
        save_state_dict(state, folder, hf_config)
        for src in side_files(model_folder):
            atomic_write_bytes(folder / src.name, unquantized_side_file(src))
    atomic_write_text(folder / STABLE, "")
    return folder


def prune_weights(run_dir: Path, keep: int | None, keep_every: int | None = None) -> list[int]:
    """Delete all but the newest `keep` step folders (STABLE first), sparing steps that are multiples of
    `keep_every` (kept for `tandem replay`); returns the deleted steps."""
    if keep is None:
        return []
    steps = sorted(int(m.group(1)) for p in (Path(run_dir) / "weights").glob("step_*") if (m := re.fullmatch(r"step_(\d+)", p.name)))
    doomed = [s for s in steps[:-max(keep, 2)] if keep_every is None or s % keep_every]
    for step in doomed:
        folder = weights_dir(run_dir, step)
        (folder / STABLE).unlink(missing_ok=True)
        shutil.rmtree(folder, ignore_errors=True)
    return doomed


def link_final(run_dir: Path, step: int) -> Path:
    """Point `weights/final` at `step_N` (replaced atomically)."""
    link = final_weights_dir(run_dir)
    tmp = link.with_name(f".{link.name}.tmp{os.getpid()}")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(weights_dir(run_dir, step).name, target_is_directory=True)
    os.replace(tmp, link)
    return link


class BackgroundWriter:
    """Runs one folder write at a time on a thread, so that the trainer's next step computes while the disk
    takes the last policy; what publishing leaves in the step is the gather to the host and the hand-off
    (`gather_full_state`; timed in `benchmarks/results/rl-loop-h200-2026-12-04.json`). The state it writes is a host
    copy of its own (`gather_full_state` copies), which the next step cannot change. A failed write is
    raised by the next `submit` or by `wait`: the trainer then stops, one step later at most, naming the error."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, write: Callable[[], object]) -> None:
        self.wait()
        self._thread = threading.Thread(target=self._run, args=(write,), name="publish", daemon=True)
        self._thread.start()

    def _run(self, write: Callable[[], object]) -> None:
        try:
            write()
        except BaseException as err:  # re-raised in the training thread
            self._error = err

    def wait(self) -> None:
        """Return once no write is in flight; raise the error of the last one, if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"writing a published weights folder failed: {error}") from error
