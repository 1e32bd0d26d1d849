"""Checkpoints to resume from: `checkpoints/step_N/trainer/`, complete or absent.

Content: a DCP (`torch.distributed.checkpoint`) save of the sharded model and optimizer state
(DCP reshards on load, so a run can resume at another world size or expert-parallel size: tensors are
saved by global name and shape, whatever mesh they were sharded over), plus `state.pt` (scheduler,
step, data position, world size) and one `rng_rank_R.pt` per rank.

Atomicity: every rank writes into `checkpoints/step_N/.trainer.tmp/`; after a barrier rank 0
renames it to `trainer/`. A folder named `trainer/` is therefore complete, and a crash mid-save
leaves only a tmp folder, which the next save of that step replaces. Multi-node runs need the
run folder on a shared file system.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from tandem.trainer.parallel.dims import ParallelDims
from tandem.transport.paths import CHECKPOINT_COMPLETE, checkpoint_dir, complete_checkpoint_steps

PROCESS = "trainer"
STATE_FILE = CHECKPOINT_COMPLETE[PROCESS]
STATE_DICT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=True)
"""Optimizer state keyed by parameter name, not by param group: the groups differ between expert-parallel
sizes (one per device mesh, `tandem.trainer.optim.param_groups`) and a checkpoint must load at any. Frozen
parameters (a LoRA run's base) are left out: they are the model folder's, unchanged."""


@dataclass
class Resumed:
    step: int
    """The last completed step; training continues at step + 1."""
    data: dict[str, Any]
    """The data position saved with it."""


def complete_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete trainer checkpoint, oldest first."""
    return [(step, checkpoint_dir(run_dir, step, PROCESS)) for step in complete_checkpoint_steps(run_dir, PROCESS)]


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def model_and_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """DCP's state dicts of what trains. `ignore_frozen_params` keeps a frozen parameter that a trained module shares
    (a tied LM head beside LoRA adapters) under its second name: every name of a frozen parameter is dropped here."""
    model_state, optim_state = get_state_dict(model, optimizer, options=STATE_DICT_OPTIONS)
    frozen = {name for name, param in model.named_parameters(remove_duplicate=False) if not param.requires_grad}
    return {k: v for k, v in model_state.items() if k not in frozen}, optim_state


def save_checkpoint(run_dir: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler, data: dict[str, Any], dims: ParallelDims,
                    base_model: dict[str, str] | None = None) -> Path:
    """Collective: every rank calls it. Returns the complete folder. `base_model`: what a LoRA run's adapters were
    trained on (`name` and `sha256`), checked when it resumes."""
    final = checkpoint_dir(run_dir, step, PROCESS)
    tmp = final.with_name(f".{PROCESS}.tmp")
    if dims.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    model_state, optim_state = model_and_optimizer_state(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp))
    torch.save(rng_state(dims.device), tmp / f"rng_rank_{dims.rank}.pt")
    if dims.is_main:
        torch.save({"step": step, "world_size": dims.world_size, "scheduler": scheduler.state_dict(), "data": data,
                    "base_model": base_model}, tmp / STATE_FILE)
    dist.barrier()
    if dims.is_main:
        if final.exists():  # an older save of this step (a run resumed from before it): the new one wins
            (final / STATE_FILE).unlink(missing_ok=True)
            shutil.rmtree(final)
        tmp.rename(final)
    dist.barrier()
    return final


def prune_checkpoints(run_dir: Path, keep: int | None) -> list[int]:
    """Delete all but the newest `keep` complete checkpoints; returns the deleted steps (rank 0 only)."""
    if keep is None:
        return []
    doomed = complete_checkpoints(run_dir)[:-keep]
    for step, folder in doomed:
        (folder / STATE_FILE).unlink()  # incomplete from here on: never picked for a resume
        shutil.rmtree(folder)
        if not any(folder.parent.iterdir()):
            folder.parent.rmdir()
    return [step for step, _ in doomed]


def scheduler_state_for(state: dict[str, Any], num_groups: int) -> dict[str, Any]:
    """A saved scheduler state for an optimizer of `num_groups` param groups. The groups differ between
    expert-parallel sizes but share one configured learning rate, so any group's entries stand for all."""
    per_group = {k: [v[0]] * num_groups for k, v in state.items() if k in ("base_lrs", "_last_lr") and v}
    return {**state, **per_group}


def load_checkpoint(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler, dims: ParallelDims,
                    base_model: dict[str, str] | None = None) -> Resumed:
    """Collective: restore model, optimizer, scheduler and (same world size only) each rank's RNG. A checkpoint of
    LoRA adapters loads only onto the base model they were trained on (`base_model`, as `save_checkpoint` took it)."""
    meta = torch.load(folder / STATE_FILE, weights_only=True)
    saved = meta.get("base_model")
    if (saved or {}).get("sha256") != (base_model or {}).get("sha256"):
        def named(base: dict[str, str] | None) -> str:
            return f"{base['name']} (sha256 {base['sha256'][:12]})" if base else "no LoRA (full weights)"
        raise ValueError(f"the checkpoint {folder} was trained on {named(saved)}; this run's model is {named(base_model)}: "
                         "resume on the same base model and `lora` setting")
    model_state, optim_state = model_and_optimizer_state(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(folder))
    # Not strict: the frozen parameters are absent on purpose; every key asked for was read (DCP fails on a missing one).
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=replace(STATE_DICT_OPTIONS, strict=False))
    scheduler.load_state_dict(scheduler_state_for(meta["scheduler"], len(optimizer.param_groups)))
    rng_file = folder / f"rng_rank_{dims.rank}.pt"
    # At another world size rank R's stream has no predecessor: it keeps its seeded start.
    if meta["world_size"] == dims.world_size and rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=True), dims.device)
    return Resumed(step=meta["step"], data=meta["data"])
