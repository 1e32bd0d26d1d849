"""The orchestrator: turns tasks into scored, packed batches while the trainer trains.

`Orchestrator.run` wires the parts and drives them: the weight watcher loads each published
policy into the servers (and runs the evals due at that policy), the scheduler starts groups
under the async gate, and each finished step is filtered for staleness, packed, sent to the
trainer ranks, logged and checkpointed. The run ends once batch `max_steps` is sent and policy
`max_steps` is loaded and evaluated.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable
from typing import Any

from tandem.config.orchestrator import OrchestratorConfig
from tandem.monitor.metrics import MetricsWriter, read_metrics
from tandem.monitor.prometheus import serve_metrics
from tandem.orchestrator.resume_state import load_checkpoint, save_checkpoint
from tandem.orchestrator.environments import LoadedEnv
from tandem.orchestrator.evaluation import evaluate
from tandem.orchestrator.inference_pool import InferencePool
from tandem.orchestrator.packing import pack_step
from tandem.orchestrator.policy import PolicyTracker, WeightWatcher
from tandem.orchestrator.policy_source import setup_policy_source
from tandem.orchestrator.rollout import GroupResult, RolloutContext, episode_limit, run_group
from tandem.orchestrator.sample_log import rollout_record, write_samples
from tandem.orchestrator.scheduler import FinishedStep, GroupScheduler
from tandem.orchestrator.step_metrics import step_metrics
from tandem.orchestrator.task_sampler import TaskSampler
from tandem.transport.paths import rollouts_dir
from tandem.transport.rollouts import setup_rollout_sender

log = logging.getLogger("tandem.orchestrator")

SAMPLES_FILE = "samples.jsonl"


class Orchestrator:
    def __init__(self, config: OrchestratorConfig, envs: list[LoadedEnv], tokenizer: Any):
        self.config = config
        self.run_dir = config.run_dir
        self.envs = envs
        self.pool = InferencePool(config.client, config.model.name)
        self.ctx = RolloutContext(self.pool, tokenizer, config.model.name, config.seq_len,
                                  config.sampling.return_routed_experts)
        self.sampler = TaskSampler(envs, config.seed)
        self.policy = PolicyTracker(0)
        self.metrics = MetricsWriter(self.run_dir, "orchestrator",
                                     serve_metrics("orchestrator", config.prometheus.host, config.prometheus.port))
        self.sender = setup_rollout_sender(config.transport.type, self.run_dir)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_token_id = int(pad or 0)
        self.evaluated: set[int] = set()
        self.watcher = WeightWatcher(setup_policy_source(config.weight_transport, self.run_dir), self.pool, self.policy,
                                     config.weights.poll_interval_s, self._on_policy_loaded)
        self._retries_logged = 0
        self._update_s_logged = 0.0

    async def run(self) -> None:
        try:
            await self._run()
        finally:
            await self.pool.aclose()

    async def _run(self) -> None:
        cfg = self.config
        first_step = self._resume() + 1
        await self.pool.wait_healthy()
        self.ctx.seq_len = await episode_limit(self.pool, cfg.seq_len)
        watcher = self.watcher
        await watcher.source.setup(self.pool)
        await watcher.load_next()  # a resumed run samples with the newest policy, not the base model
        watcher_task = asyncio.create_task(watcher.run())
        groups_per_step = cfg.batch_size // cfg.group_size
        scheduler = GroupScheduler(
            self._start_group, self.policy, first_step=first_step, last_step=cfg.max_steps,
            max_async_level=cfg.max_async_level, groups_per_step=groups_per_step,
            max_replacements=int(cfg.advantage.max_replacement_ratio * groups_per_step),
            max_inflight_groups=max(1, cfg.max_concurrent_rollouts // cfg.group_size),
            filter_zero=cfg.advantage.filter_zero_groups, wait_timeout_s=cfg.weights.wait_timeout_s,
        )
        try:
            async with contextlib.aclosing(scheduler.steps()) as steps:  # stops in-flight groups on error
                async for finished in steps:
                    self._finish_step(finished)
            log.info("all %d batches sent; waiting for policy %d", cfg.max_steps, cfg.max_steps)
            try:
                await _unless_failed(asyncio.wait_for(watcher.wait_handled(cfg.max_steps), cfg.weights.wait_timeout_s),
                                     watcher_task)
            except TimeoutError:
                raise TimeoutError(f"the trainer did not publish policy {cfg.max_steps} within "
                                   f"{cfg.weights.wait_timeout_s:.0f}s (`weights.wait_timeout_s`)") from None
        finally:
            watcher_task.cancel()
            await asyncio.gather(watcher_task, return_exceptions=True)

    def _resume(self) -> int:
        """The last finished step of the checkpoint resumed from (0 for a fresh run)."""
        if not self.config.ckpt.resume:
            return 0
        wanted = self.config.ckpt.resume_step
        state = load_checkpoint(self.run_dir, wanted)
        if state is None and wanted is not None:
            raise FileNotFoundError(f"`ckpt.resume_step` = {wanted}: {self.run_dir} holds no complete orchestrator checkpoint of that step")
        if state is None:
            log.warning("ckpt.resume: no orchestrator checkpoint in %s; starting at step 1", self.run_dir)
            return 0
        self.sampler.load_state_dict(state["sampler"])
        step = int(state["step"])
        # The stopped run's evals up to the checkpoint stay in the run folder (the cut keeps them): evaluating one
        # of those policies again would log its eval twice.
        self.evaluated = {r["step"] for r in read_metrics(self.run_dir, "orchestrator")
                          if "eval/reward_mean" in r and isinstance(r.get("step"), int) and r["step"] <= step}
        log.info("resumed from the orchestrator checkpoint of step %d", step)
        return step

    def _start_group(self, step: int) -> Awaitable[GroupResult]:
        cfg = self.config
        env, example = self.sampler.next()
        seeds = None
        if cfg.sampling.seeded:
            first = cfg.seed * 1_000_003 + (self.sampler.num_draws - 1) * cfg.group_size
            seeds = [(first + j) % 2**31 for j in range(cfg.group_size)]
        return run_group(self.ctx, env, example, step, cfg.group_size, cfg.sampling.request_args(), cfg.advantage,
                         cfg.sampling.max_tokens, seeds)

    def _finish_step(self, finished: FinishedStep) -> None:
        cfg, groups, step = self.config, finished.groups, finished.groups.step
        if not groups.used:
            errors = [r.error for g in groups.failed for r in g.rollouts if r.error]
            raise RuntimeError(f"step {step}: all {groups.num_started} groups failed; last error: {errors[-1] if errors else '?'}")
        start = time.monotonic()
        oldest_allowed = step - 1 - cfg.max_off_policy_steps
        samples, num_dropped, records = [], 0, []
        for group in groups.used:
            for rollout in group.rollouts:
                fresh = [s for s in rollout.samples if s.oldest_version >= oldest_allowed]
                num_dropped += len(rollout.samples) - len(fresh)
                samples.extend(fresh)
                status = "failed" if rollout.failed else "trained" if fresh else "dropped"
                records.append(rollout_record(rollout, status))
        for group in groups.discarded:
            records.extend(rollout_record(r, "failed" if r.failed else "filtered") for r in group.rollouts)
        batches, stats = pack_step(step, samples, cfg.seq_len, cfg.num_trainer_ranks, self.pad_token_id)
        self.sender.send(step, batches)
        pack_s = time.monotonic() - start
        retries, self._retries_logged = self.pool.num_retries - self._retries_logged, self.pool.num_retries
        update_s, self._update_s_logged = self.watcher.update_s - self._update_s_logged, self.watcher.update_s
        metrics = step_metrics(step, finished, samples, num_dropped, stats, pack_s, self.policy.version, retries,
                               update_s)
        self.metrics.log(step, metrics)
        write_samples(rollouts_dir(self.run_dir, step) / SAMPLES_FILE, records)
        if num_dropped:
            log.warning("step %d: dropped %d sample(s) older than policy %d", step, num_dropped, oldest_allowed)
        log.info("step %d | reward %.3f ± %.3f | %d samples, %d loss tokens | %.1f rollouts/s | off-policy max %d "
                 "| waited on trainer %.2fs", step, metrics["reward/mean"], metrics["reward/std"], len(samples),
                 stats.num_loss_tokens, metrics["throughput/rollouts_per_s"], metrics["off_policy/max"],
                 finished.wait_trainer_s)
        if cfg.ckpt.enabled and step % cfg.ckpt.interval == 0:
            save_checkpoint(self.run_dir, step, {"sampler": self.sampler.state_dict()})

    def _eval_due(self, version: int) -> bool:
        """At policy 0, the last policy, and the first policy loaded at or past each multiple of
        `eval.interval` (the watcher may skip versions when the trainer publishes fast)."""
        interval = self.config.eval.interval
        if interval == 0 or version in self.evaluated:
            return False
        last = max(self.evaluated, default=-1)
        return version == 0 or version == self.config.max_steps or version // interval > max(last, 0) // interval

    async def _on_policy_loaded(self, version: int) -> None:
        if not self._eval_due(version):
            return
        cfg = self.config
        metrics, results = await evaluate(self.ctx, self.envs, cfg.eval, cfg.sampling, cfg.seed,
                                          cfg.max_concurrent_rollouts)
        self.evaluated.add(version)
        self.metrics.log(version, metrics)
        write_samples(self.run_dir / "eval" / f"step_{version}" / SAMPLES_FILE,
                      [rollout_record(r, "failed" if r.failed else "eval") for r in results])
        log.info("eval at policy %d | reward %.3f | %s", version, metrics.get("eval/reward_mean", float("nan")),
                 " ".join(f"{k[5:]} {v:.3f}" for k, v in metrics.items() if k.startswith("eval/pass@")))


async def _unless_failed(waiting: Awaitable[None], watcher_task: asyncio.Task) -> None:
    """Await `waiting`, but raise at once if the watcher died first."""
    wait_task = asyncio.ensure_future(waiting)
    done, _ = await asyncio.wait([wait_task, watcher_task], return_when=asyncio.FIRST_COMPLETED)
    if wait_task not in done:
        wait_task.cancel()
        watcher_task.result()
        raise RuntimeError("the weight watcher stopped early")
    wait_task.result()
