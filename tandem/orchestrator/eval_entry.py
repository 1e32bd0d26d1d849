"""`tandem eval @ cfg`: score the model the inference servers hold on environments' eval splits.

Writes `<run_dir>/eval/step_<step>/samples.jsonl`, appends one `eval` line to `metrics.jsonl`, and
prints the metrics.
"""

from __future__ import annotations

import asyncio
from typing import Any

from tandem.config.eval import EvalConfig
from tandem.monitor.logging import setup_logging
from tandem.monitor.stop_signals import stops_cleanly


async def run_eval(config: EvalConfig, envs: list, tokenizer: Any) -> tuple[dict[str, float], list]:
    from tandem.monitor.progress import bar_once_total_known
    from tandem.orchestrator.evaluation import evaluate
    from tandem.orchestrator.inference_pool import InferencePool
    from tandem.orchestrator.rollout import RolloutContext, episode_limit

    pool = InferencePool(config.client, config.model.name)
    try:
        await pool.wait_healthy()
        ctx = RolloutContext(pool, tokenizer, config.model.name, await episode_limit(pool, config.seq_len))
        with bar_once_total_known("eval", "rollout") as on_progress:  # the total is known at the first finished rollout
            return await evaluate(ctx, envs, config.eval, config.sampling, config.seed, config.max_concurrent_rollouts,
                                  on_progress)
    finally:
        await pool.aclose()


@stops_cleanly("eval")
def main(config: EvalConfig) -> int:
    from tandem.monitor.metrics import MetricsWriter
    from tandem.orchestrator.environments import load_envs
    from tandem.orchestrator.orchestrator import SAMPLES_FILE
    from tandem.orchestrator.sample_log import rollout_record, write_samples
    from tandem.orchestrator.tokenizer import load_tokenizer

    setup_logging("eval")
    tokenizer = load_tokenizer(config.model)
    envs = load_envs(config.envs)
    metrics, results = asyncio.run(run_eval(config, envs, tokenizer))
    MetricsWriter(config.run_dir, "eval").log(config.step, metrics)
    write_samples(config.run_dir / "eval" / f"step_{config.step}" / SAMPLES_FILE,
                  [rollout_record(r, "failed" if r.failed else "eval") for r in results])
    width = max(map(len, metrics))
    for key, value in metrics.items():
        print(f"{key:<{width}}  {value:.4f}" if isinstance(value, float) else f"{key:<{width}}  {value}")
    return 0
