"""What both trainers set up and tear down the same way: ranks, model, optimizer, schedule,
resume, weight publishing, checkpoints and per-step metrics.

The RL and SFT loops differ only in where micro-batches come from and in their objective; they
drive a `Session` and never touch FSDP, DCP or the run folder layout themselves.
"""

from __future__ import annotations

import logging
import resource
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tandem.config.trainer import TrainingProcessConfig
from tandem.models.hub import resolve_model_path
from tandem.models.loading import read_hf_config
from tandem.models.lora import base_fingerprint
from tandem.models.weights import weight_files
from tandem.monitor.metrics import MetricsWriter
from tandem.monitor.prometheus import serve_metrics
from tandem.trainer.broadcast_publish import WeightBroadcaster
from tandem.trainer.checkpoint import complete_checkpoints, load_checkpoint, prune_checkpoints, save_checkpoint
from tandem.trainer.model import (PolicyModel, announced_state, build_policy, full_parameters, gather_full_state,
                                  published_dtypes, to_published)
from tandem.trainer.optim import build_optimizer, build_scheduler
from tandem.trainer.parallel.context_parallel import check_context_parallel
from tandem.trainer.parallel.dims import ParallelDims, close_parallel, init_parallel
from tandem.trainer.parallel.expert_parallel import check_expert_parallel
from tandem.trainer.publish import BackgroundWriter, prune_weights, published_dtype, write_weights_folder


@dataclass
class Session:
    config: TrainingProcessConfig
    dims: ParallelDims
    model: PolicyModel
    hf_config: dict
    model_folder: Path
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    log: logging.Logger
    metrics: MetricsWriter | None
    start_step: int = 0
    """The last step already done (0 for a fresh run, the checkpoint's step after a resume)."""
    data_position: dict[str, Any] = field(default_factory=dict)
    """Data position restored from the checkpoint (empty for a fresh run)."""
    broadcaster: WeightBroadcaster | None = None
    """Rank 0 with the broadcast weight transport: publishing sends over the group instead of writing folders."""
    writer: BackgroundWriter = field(default_factory=BackgroundWriter)
    """Writes published folders while training goes on (`publish`)."""
    base_model: dict[str, str] | None = None
    """A LoRA run's base model, `name` and `sha256` (`tandem.models.lora.base_fingerprint`), saved with each checkpoint
    and checked at resume; None for full fine-tuning."""

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config["vocab_size"])

    def publish(self, step: int) -> None:
        """Write `weights/step_N/` (collective gather; rank 0 writes, on the background `writer` before the
        last step, whose folder is the run's result and is whole when this returns) and prune old folders;
        with a `broadcaster`, send the weights instead, and write the folder only at the last step."""
        dtype = published_dtype(self.hf_config)
        if self.broadcaster is not None and step < self.config.max_steps:
            # From the device, one parameter at a time: no host copy, at most a bucket in device memory. The
            # other ranks (no broadcaster) take part in the same gathers through `gather_full_state` below.
            dtypes = published_dtypes(self.model, dtype)
            tensors = ((name, to_published(full, dtypes[name], self.dims.device)) for name, full in full_parameters(self.model))
            self.log_broadcast(step, self.broadcaster.send(step, announced_state(self.model, dtype), tensors))
            return
        state = gather_full_state(self.model, dtype, keep=self.dims.is_main)
        if not self.dims.is_main:
            return
        if self.broadcaster is not None:  # the last step: the host copy that is also the run's result folder
            self.log_broadcast(step, self.broadcaster.send(step, state))

        def write() -> None:
            write_weights_folder(self.config.run_dir, step, state, self.model_folder, self.hf_config, self.model.lora,
                                 self.config.model.name)
            prune_weights(self.config.run_dir, self.config.weights.keep, self.config.weights.keep_every)

        if step < self.config.max_steps:
            self.writer.submit(write)
        else:
            self.writer.wait()
            write()

    def log_broadcast(self, step: int, num_bytes: int) -> None:
        fp8 = " (dense projections in FP8 blocks)" if self.broadcaster.fp8_weights else ""
        self.log.info("step %d: policy broadcast, %.1f MiB sent%s", step, num_bytes / 2**20, fp8)

    def should_publish(self, step: int) -> bool:
        return step % self.config.weights.interval == 0 or step == self.config.max_steps

    def maybe_checkpoint(self, step: int, data_position: dict[str, Any]) -> Path | None:
        ckpt = self.config.ckpt
        if not ckpt.enabled or not (step % ckpt.interval == 0 or step == self.config.max_steps):
            return None
        folder = save_checkpoint(self.config.run_dir, step, self.model, self.optimizer, self.scheduler, data_position, self.dims,
                                 self.base_model)
        if self.dims.is_main:
            prune_checkpoints(self.config.run_dir, ckpt.keep)
            self.log.info("step %d: checkpoint %s", step, folder)
        return folder

    def log_step(self, step: int, values: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.log(step, values)

    def close(self, wait_for_peers: bool = False) -> None:
        """`wait_for_peers`: the run ended normally on this rank, so every rank will reach the barrier."""
        self.writer.wait()
        if self.broadcaster is not None:
            self.broadcaster.close()
        close_parallel(wait_for_peers)

    def run_and_close(self, work: Callable[[], None], bad_input: type[Exception], what: str) -> int:
        """Run `work`, close the session, and return the process's exit code: 0, or 1 when `work` raised
        `bad_input` (logged as `what`). Only a rank whose work ended normally waits for its peers at the close:
        the peers of a rank that stopped may never reach the barrier. Other errors propagate."""
        completed = False
        try:
            work()
            completed = True
        except bad_input as err:
            self.log.error("%s, stopping: %s", what, err)
            return 1
        finally:
            self.close(wait_for_peers=completed)
        return 0


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated device memory since the last reset on CUDA; peak resident memory of the process on CPU."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30  # ru_maxrss is in KiB on Linux


def base_model_fingerprint(folder: Path, load_format: str) -> str:
    """The base's `base_fingerprint`: of config.json alone for `dummy` weights (made from its shapes and a fixed seed)."""
    return base_fingerprint(folder, [] if load_format == "dummy" else weight_files(folder))


def open_session(config: TrainingProcessConfig, process: str) -> Session:
    """Join the ranks, build the model and optimizer, and resume if asked."""
    from tandem.monitor.logging import setup_logging

    log = setup_logging(process)
    folder = resolve_model_path(config.model.name)
    # A bad expert- or context-parallel size is found from config.json alone, before joining the ranks.
    hf_config = read_hf_config(folder)
    check_expert_parallel(config.parallel.ep, hf_config, str(folder / "config.json"))
    check_context_parallel(config.parallel.cp, config.parallel.cp_attention, hf_config, str(folder / "config.json"))
    dims = init_parallel(config.device, config.parallel.ep, config.parallel.cp)
    if not dims.is_main:  # one rank tells the story; the others speak up only when something is wrong
        log.setLevel(logging.WARNING)
    try:
        if config.fp8.enabled:
            from tandem.trainer.float8 import check_float8_device  # torchao, only for FP8 runs

            check_float8_device(dims.device)
        torch.manual_seed(config.seed + dims.rank)
        model, hf_config = build_policy(config.model, config.parallel, dims, config.logprob_chunk_size, config.kernels,
                                       config.router, config.run.exact, config.lora, config.seed, config.fp8,
                                       config.mtp)
        optimizer = build_optimizer(model, config.optim)
        scheduler = build_scheduler(optimizer, config.scheduler, config.max_steps)
        metrics = (MetricsWriter(config.run_dir, process, serve_metrics(process, config.prometheus.host, config.prometheus.port))
                   if dims.is_main else None)
        session = Session(config, dims, model, hf_config, folder, optimizer, scheduler, log, metrics)
        if config.lora.enabled:
            session.base_model = {"name": config.model.name, "sha256": base_model_fingerprint(folder, config.model.load_format)}
        if config.ckpt.resume:
            _resume(session)
        if config.fp8.enabled:  # after a resume: of the weights the run goes on from
            from tandem.trainer.float8 import keep_scales_precomputed

            keep_scales_precomputed(optimizer, model)
    except BaseException:
        close_parallel()
        raise
    log.info("%s: %d rank(s) on %s, model %s, starting after step %d", process, dims.world_size, dims.device,
             config.model.name, session.start_step)
    return session


def _resume(session: Session) -> None:
    wanted = session.config.ckpt.resume_step
    found = [(s, f) for s, f in complete_checkpoints(session.config.run_dir) if wanted in (None, s)] if session.dims.is_main else []
    choice = [found[-1][1] if found else None]
    dist.broadcast_object_list(choice, src=0)  # every rank loads the folder rank 0 picked
    if choice[0] is None and wanted is not None:
        raise FileNotFoundError(f"`ckpt.resume_step` = {wanted}: {session.config.run_dir} holds no complete trainer "
                                "checkpoint of that step")
    if choice[0] is None:
        session.log.warning("ckpt.resume is set but %s holds no complete checkpoint: starting from step 0",
                            session.config.run_dir / "checkpoints")
        return
    resumed = load_checkpoint(Path(choice[0]), session.model, session.optimizer, session.scheduler, session.dims,
                              session.base_model)
    session.start_step, session.data_position = resumed.step, resumed.data
    session.log.info("resumed from %s (step %d, data position %s)", choice[0], resumed.step, resumed.data)
