"""The RL trainer (`tandem trainer`): batch N trains policy N-1 into policy N.

Per step: wait for this rank's batch (or make a fake one), check it, forward/backward over its
rows, clip, NaN-guard, step, publish `weights/step_N/`, checkpoint when due, log metrics. Exit 0
after `max_steps`; a bad batch or a missing model stops every rank with a message, exit 1. With
`lora.share_base` the frozen base is published for the servers before step 1 and held after the last
step until the run is stopped (`tandem.trainer.shared_base`).
"""

from __future__ import annotations

import time

import torch

from tandem.config.run_folder import prepare_run_folder
from tandem.config.trainer import TrainerConfig
from tandem.models.fp8 import fp8_weight_names
from tandem.monitor.stop_signals import Stopped, stopping_on_signals
from tandem.trainer.batch import prepare_micro_batches
from tandem.trainer.micro_batch import MicroBatch
from tandem.trainer.broadcast_publish import WeightBroadcaster
from tandem.trainer.data import BatchError, check_step_batch, fake_batch, wait_for_batch
from tandem.trainer.loss import LossFn, LossInputs, build_loss, mismatch_kl
from tandem.trainer.model import TokenLogprobs
from tandem.trainer.session import Session, open_session, peak_memory_gib
from tandem.trainer.shared_base import hold_for_servers
from tandem.trainer.step import Objective, ObjectiveOutput, train_step
from tandem.transport.paths import rollout_file
from tandem.transport.types import TrainingBatch


def rl_objective(loss_fn: LossFn) -> Objective:
    """Sums over loss tokens of the loss and its metrics (mismatch KL, clipped/masked fractions)."""

    def objective(mb: MicroBatch, out: TokenLogprobs) -> ObjectiveOutput:
        x = LossInputs(out.logprobs, mb.inference_logprobs, mb.advantages, mb.loss_mask)
        result = loss_fn(x)
        mask = mb.loss_mask

        def masked_sum(t: torch.Tensor) -> torch.Tensor:
            return torch.where(mask, t, 0.0).sum()

        # Mismatch KL is measured on on-policy tokens only: there trainer and inference hold the
        # same weights, so any gap is numerical. Off-policy tokens measure the policy's drift.
        kl = mismatch_kl(x)
        on = mb.on_policy.float()
        sums = {"mismatch_kl_sum": masked_sum(kl * on), "on_policy_fraction": masked_sum(on),
                "off_policy_kl_sum": masked_sum(kl * (1 - on))}
        sums |= {k: masked_sum(v).detach() for k, v in result.fractions.items()}
        return ObjectiveOutput(masked_sum(result.per_token), sums)

    return objective


def kl_metrics(means: dict[str, float]) -> dict[str, float | None]:
    """Turn the objective's per-loss-token sums into KL means over on- and off-policy tokens."""
    on = means.pop("on_policy_fraction")
    kl_on, kl_off = means.pop("mismatch_kl_sum"), means.pop("off_policy_kl_sum")
    return {"on_policy_fraction": on, "mismatch_kl": kl_on / on if on > 0 else None,
            "off_policy_kl": kl_off / (1 - on) if on < 1 else None}


def next_batch(config: TrainerConfig, session: Session, step: int) -> TrainingBatch:
    dims = session.dims
    if config.data.fake:
        return fake_batch(step, dims.rank, dims.world_size, config.data, config.seq_len, session.vocab_size, config.seed)
    return wait_for_batch(config.run_dir, step, dims.rank, config.data.poll_interval_s, config.data.wait_timeout_s)


def open_weight_transport(config: TrainerConfig, session: Session) -> None:
    """With the broadcast transport: rank 0 joins the servers' group (blocking until they join), and
    a resumed run re-sends its policy, which the servers may not hold (they restarted with the run)."""
    if config.weight_transport.type != "broadcast":
        return
    if session.dims.is_main:
        transport = config.weight_transport
        fp8_weights = (fp8_weight_names(session.model.lm, transport.fp8_experts) if transport.quantization == "fp8"
                       else ())
        session.broadcaster = WeightBroadcaster(config.run_dir, transport, session.dims.device, fp8_weights)
        session.log.info("weight broadcast group of %d ranks formed", config.weight_transport.world_size)
    if session.start_step > 0:
        session.publish(session.start_step)


def train(config: TrainerConfig, session: Session, objective: Objective) -> None:
    dims = session.dims
    for step in range(session.start_step + 1, config.max_steps + 1):
        t0 = time.perf_counter()
        batch = next_batch(config, session, step)
        t_batch = time.perf_counter()
        source = "fake batch" if config.data.fake else str(rollout_file(config.run_dir, step, dims.rank))
        check_step_batch(batch, config.seq_len, session.vocab_size, source, dims, config.loss.router_replay)
        micro_batches = prepare_micro_batches(batch.rows, dims, policy_version=step - 1,
                                              router_replay=config.loss.router_replay)
        result = train_step(session.model, session.optimizer, session.scheduler, micro_batches, objective,
                            batch.num_loss_tokens, config.optim.max_grad_norm, dims)
        t_train = time.perf_counter()
        kl = kl_metrics(result.metrics)  # pops the raw KL sums out of the metrics
        if session.should_publish(step):
            session.publish(step)
        t_publish = time.perf_counter()
        session.maybe_checkpoint(step, {"step": step})
        num_tokens = sum(len(row.input_ids) for row in batch.rows) * dims.world_size
        if result.skipped:
            session.log.warning("step %d: non-finite loss or gradient norm (loss %s, grad_norm %s): update skipped",
                                step, result.loss, result.grad_norm)
        session.log_step(step, {
            "loss": result.loss, "grad_norm": result.grad_norm, "lr": result.lr, **kl, **result.metrics,
            "skipped": int(result.skipped), "num_tokens": num_tokens, "num_loss_tokens": batch.num_loss_tokens,
            "tokens_per_s": num_tokens / max(t_train - t_batch, 1e-9), "time_step": t_train - t_batch,
            "time_wait_batch": t_batch - t0, "time_publish": t_publish - t_train,
            "peak_memory_gib": peak_memory_gib(dims.device), **result.router,
        })
        session.log.info("step %d: loss %.4g grad_norm %.3g lr %.3g entropy %.3g %.0f tok/s", step, result.loss,
                         result.grad_norm, result.lr, result.metrics.get("entropy", float("nan")), num_tokens / max(t_train - t_batch, 1e-9))


def main(config: TrainerConfig) -> int:
    from tandem.monitor.logging import setup_logging

    try:
        objective = rl_objective(build_loss(config.loss))
        session = open_session(config, "trainer")
    except (FileNotFoundError, KeyError, ValueError) as err:
        setup_logging("trainer").error("cannot start the trainer: %s", err)
        return 1

    shared = session.model.shared_base

    def run() -> None:
        if session.dims.is_main:  # what `tandem replay` reads back
            prepare_run_folder(config, "trainer")
        if shared is not None:
            session.log.info("frozen base shared with the inference servers: %s", shared.publish(config.run_dir))
        open_weight_transport(config, session)
        train(config, session, objective)
        if shared is not None:
            hold_for_servers(config.run_dir, session.log)

    if shared is None:
        return session.run_and_close(run, BatchError, "bad input")
    # Stopped by the launcher (the run's end, for a trainer holding its base): a signal unwinds, and the buffer's
    # shared-memory file on the CPU, the size of the model, is removed.
    try:
        with stopping_on_signals():
            return session.run_and_close(run, BatchError, "bad input")
    except Stopped as err:
        session.log.info("%s", err)
        return 1
    finally:
        shared.buffer.remove()
