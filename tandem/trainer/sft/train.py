"""Supervised fine-tuning (`tandem sft @ cfg`): cross-entropy on the loss tokens of packed rows.

Writes the same `weights/step_N/` folders as the RL trainer, always including
`weights/step_{max_steps}`, and points `weights/final` at it: that is the folder an RL run starts
from. Eval loss (mean per loss token over the held-out rows) every `eval.interval` steps.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import torch

from tandem.config.run_folder import remove_run, results_in
from tandem.config.sft import SFTConfig
from tandem.monitor.progress import bar_once_total_known
from tandem.monitor.stop_signals import held_signals, stops_cleanly
from tandem.trainer.batch import prepare_micro_batches
from tandem.trainer.micro_batch import MicroBatch
from tandem.trainer.model import TokenLogprobs
from tandem.trainer.publish import link_final
from tandem.trainer.session import Session, open_session, peak_memory_gib
from tandem.trainer.sft.data import SFTDataError, StepRows, load_samples, pack, padding_row, split_eval
from tandem.trainer.step import ObjectiveOutput, count_loss_tokens, evaluate, train_step
from tandem.transport.types import PackedRow


def sft_objective(mb: MicroBatch, out: TokenLogprobs) -> ObjectiveOutput:
    """Negative log-likelihood summed over the loss tokens."""
    return ObjectiveOutput(torch.where(mb.loss_mask, -out.logprobs, 0.0).sum(), {})


@dataclass
class SFTData:
    train: StepRows
    eval_rows: list[PackedRow]
    pad_id: int


def load_data(config: SFTConfig, log) -> SFTData:
    """Tokenize and pack the train and eval data (every rank does it the same way)."""
    from transformers import AutoTokenizer

    from tandem.models.hub import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_path(config.model.name)))
    data = config.data
    first_rank = os.environ.get("RANK", "0") == "0"  # before the session: the rank is torchrun's
    with bar_once_total_known("sft data", "row") as progress:  # a large file takes minutes
        train, counts = load_samples(data.path, tokenizer, data.loss_roles, config.seq_len, progress if first_rank else None)
    log.info("SFT data %s: %s", data.path, counts)
    held: list = []
    if data.eval_path is not None:
        held, eval_counts = load_samples(data.eval_path, tokenizer, data.loss_roles, config.seq_len)
        log.info("SFT eval data %s: %s", data.eval_path, eval_counts)
    elif data.eval_fraction > 0:
        train, held = split_eval(train, data.eval_fraction, config.seed)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return SFTData(StepRows(train, config.seq_len, data.rows_per_step, data.shuffle, config.seed), pack(held, config.seq_len), pad_id)


def eval_batches(data: SFTData, session: Session) -> list[MicroBatch]:
    """This rank's share of the eval rows, padded so that every rank runs the same number of passes."""
    dims = session.dims
    per_rank = math.ceil(len(data.eval_rows) / dims.world_size)
    mine = data.eval_rows[dims.rank::dims.world_size]
    mine += [padding_row(data.pad_id)] * (per_rank - len(mine))
    return prepare_micro_batches(mine, dims)


def train(config: SFTConfig, session: Session, data: SFTData) -> None:
    dims = session.dims
    evals = eval_batches(data, session) if config.eval.interval else []
    for step in range(session.start_step + 1, config.max_steps + 1):
        with held_signals():  # a signal stops SFT between steps: never amid an update, a publish or a checkpoint
            rows, epochs = data.train.rows_for(step, dims.rank, dims.world_size)
            micro_batches = prepare_micro_batches(rows, dims)
            t0 = time.perf_counter()
            num_loss_tokens = count_loss_tokens(micro_batches, dims)
            result = train_step(session.model, session.optimizer, session.scheduler, micro_batches, sft_objective,
                                num_loss_tokens, config.optim.max_grad_norm, dims)
            t_train = time.perf_counter()
            values = {"loss": result.loss, "grad_norm": result.grad_norm, "lr": result.lr, **result.metrics,
                      "skipped": int(result.skipped), "epoch": epochs, "num_loss_tokens": num_loss_tokens,
                      **result.router}
            if config.eval.interval and (step % config.eval.interval == 0 or step == config.max_steps):
                values["eval_loss"] = evaluate(session.model, evals, sft_objective, dims)
            if session.should_publish(step):
                session.publish(step)
            session.maybe_checkpoint(step, {"step": step, "epochs": epochs})
            num_tokens = sum(len(row.input_ids) for row in rows) * dims.world_size
            values |= {"num_tokens": num_tokens, "tokens_per_s": num_tokens / max(t_train - t0, 1e-9), "time_step": t_train - t0,
                       "peak_memory_gib": peak_memory_gib(dims.device)}
            session.log_step(step, values)
            session.log.info("step %d: loss %.4g%s grad_norm %.3g lr %.3g", step, result.loss,
                             f" eval_loss {values['eval_loss']:.4g}" if "eval_loss" in values else "", result.grad_norm, result.lr)
    if dims.is_main:
        link_final(config.run_dir, config.max_steps)


def claims_run_folder(config: SFTConfig, log) -> bool:
    """Whether SFT may write `output_dir` (`tandem.config.run_folder`): it holds no run, or `ckpt.resume` continues
    the one it holds, or `clean` removes it (the first rank does)."""
    held = results_in(config.run_dir)
    if held and config.clean and os.environ.get("RANK", "0") == "0":
        remove_run(config.run_dir)
    elif held and not config.clean and not config.ckpt.resume:
        log.error("%s already holds a run (%s): pass --ckpt.resume to continue it or --clean to start over",
                  config.run_dir, ", ".join(held))
        return False
    return True


@stops_cleanly("sft")
def main(config: SFTConfig) -> int:
    from tandem.monitor.logging import setup_logging

    log = setup_logging("sft")
    if not claims_run_folder(config, log):
        return 1
    try:
        data = load_data(config, log)
        session = open_session(config, "sft")
    except (SFTDataError, FileNotFoundError, KeyError, ValueError) as err:
        log.error("cannot start SFT: %s", err)
        return 1
    return session.run_and_close(lambda: train(config, session, data), SFTDataError, "bad SFT data")
