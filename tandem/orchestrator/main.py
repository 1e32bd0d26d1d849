"""`tandem orchestrator @ cfg`: the entry point of the orchestrator process."""

from __future__ import annotations

import asyncio

from tandem.config.orchestrator import OrchestratorConfig
from tandem.monitor.logging import setup_logging


def main(config: OrchestratorConfig) -> int:
    from tandem.orchestrator.environments import load_envs
    from tandem.orchestrator.orchestrator import Orchestrator
    from tandem.orchestrator.tokenizer import load_tokenizer

    log = setup_logging("orchestrator")
    tokenizer = load_tokenizer(config.model)
    envs = load_envs(config.envs)
    log.info("orchestrator: %d env(s) %s, %d steps of %d rollouts, servers %s", len(envs),
             [e.name for e in envs], config.max_steps, config.batch_size, config.client.base_urls)
    asyncio.run(Orchestrator(config, envs, tokenizer).run())
    return 0
