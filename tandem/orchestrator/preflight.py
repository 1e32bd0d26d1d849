"""The orchestrator's preflight mode (`tandem orchestrator-preflight @ orchestrator.toml`, run by `tandem rl`
before step 1, once the inference servers answer).

It does the orchestrator's half of the preflight with the orchestrator's own parts, so that the probe is what
training will see: `preflight.num_conversations` two-turn conversations sampled by the first server over HTTP,
each prompt rendered from the whole conversation by the chat template as rollouts are; their samples merged by
`build_samples`, which counts the prefix breaks (turn k's tokens not a prefix of turn k+1's prompt: each break
starts a new sample, paying the context again); the samples packed for the trainer's ranks as a step is packed
(`preflight/probe/rank_R.msgpack`, which `tandem trainer-preflight` recomputes). Its findings go to
`preflight/orchestrator.json`, from which the launcher builds the report.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from tandem.config.orchestrator import OrchestratorConfig
from tandem.models.chat import render_chat
from tandem.monitor.logging import setup_logging
from tandem.orchestrator.packing import pack_step
from tandem.orchestrator.samples import Sample, Turn, build_samples
from tandem.orchestrator.server_dialect import dialect_of
from tandem.orchestrator.tokenizer import load_tokenizer
from tandem.transport.files import atomic_write_bytes, atomic_write_text
from tandem.transport.paths import preflight_orchestrator_report, probe_file
from tandem.transport.types import encode_batch

PROBE_PROMPTS = ("Reverse the words: the quick brown fox.", "What is 12 times 7?", "Name three colors.",
                 "Write one short sentence about rivers.")
FOLLOW_UP = "Say it again, differently."


def sample_conversation(client: httpx.Client, base_url: str, tokenizer: Any, index: int,
                        config: OrchestratorConfig) -> tuple[list[Turn], list[str]]:
    """Two model turns of one probe conversation, each prompt rendered from the whole conversation so far;
    also the problems the server's answers show (an echoed prompt that is not the one sent: a tokenizer mismatch)."""
    messages = [{"role": "user", "content": PROBE_PROMPTS[index % len(PROBE_PROMPTS)]}]
    temperature = config.sampling.temperature
    dialect = dialect_of(config.client.backend, config.model.name)
    turns, problems = [], []
    for _ in range(2):
        prompt = render_chat(tokenizer, messages)
        body = {"prompt_token_ids": prompt, "max_tokens": config.preflight.max_tokens, "temperature": temperature,
                "seed": config.seed + index}
        response = client.post(f"{base_url}{dialect.generate_path}", json=dialect.to_request(body))
        response.raise_for_status()
        answer = dialect.from_response(response.json(), 0)
        if answer.get("prompt_token_ids", prompt) != prompt:  # vLLM's token-in route echoes no prompt
            problems.append("the server's prompt_token_ids differ from the tokens sent")
        choice = answer["choices"][0]
        turns.append(Turn(prompt, choice["token_ids"], choice["logprobs"], 0, temperature))
        messages += [{"role": "assistant", "content": tokenizer.decode(choice["token_ids"], skip_special_tokens=True)},
                     {"role": "user", "content": FOLLOW_UP}]
    return turns, problems


def probe(config: OrchestratorConfig, tokenizer: Any) -> tuple[list[Sample], dict[str, Any]]:
    """The probe conversations, sampled concurrently from the first server: their samples, and the findings
    the launcher's report needs (prefix breaks, problems, the probe's size, the server's tokens/s)."""
    num = config.preflight.num_conversations
    headers = {"Authorization": f"Bearer {config.client.api_key}"} if config.client.api_key else {}
    base_url = config.client.base_urls[0]
    start = time.perf_counter()
    with httpx.Client(timeout=config.client.timeout_s, headers=headers) as client, ThreadPoolExecutor(num) as pool:
        results = list(pool.map(lambda i: sample_conversation(client, base_url, tokenizer, i, config), range(num)))
    seconds = time.perf_counter() - start
    conversations = [turns for turns, _ in results]
    samples = [s for turns in conversations for s in build_samples(turns)]
    completion_tokens = sum(len(t.completion_ids) for turns in conversations for t in turns)
    findings = {"problems": sorted({p for _, found in results for p in found}),
                "num_turns": sum(len(turns) for turns in conversations),
                "num_prefix_breaks": len(samples) - len(conversations),
                "num_samples": len(samples), "num_sample_tokens": sum(len(s) for s in samples),
                "completion_tokens": completion_tokens, "gen_tokens_per_s": completion_tokens / max(seconds, 1e-9)}
    return samples, findings


def write_probe(config: OrchestratorConfig, samples: list[Sample], pad_token_id: int) -> None:
    """The probe's samples packed for the trainer's ranks as a step is packed (step 0)."""
    batches, _ = pack_step(0, samples, config.seq_len, config.num_trainer_ranks, pad_token_id)
    for batch in batches:
        atomic_write_bytes(probe_file(config.run_dir, batch.rank), encode_batch(batch))


def main(config: OrchestratorConfig) -> int:
    log = setup_logging("orchestrator")
    try:
        tokenizer = load_tokenizer(config.model)
        samples, findings = probe(config, tokenizer)
    except (httpx.HTTPError, ValueError) as err:
        log.error("cannot run the orchestrator's preflight against %s: %s", config.client.base_urls[0], err)
        return 1
    write_probe(config, samples, tokenizer.pad_token_id or 0)
    atomic_write_text(preflight_orchestrator_report(config.run_dir), json.dumps(findings, indent=1))
    log.info("preflight probe: %d turns, %d prefix breaks, %d samples", findings["num_turns"],
             findings["num_prefix_breaks"], findings["num_samples"])
    return 0
