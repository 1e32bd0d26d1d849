"""The preflight of `tandem rl`: checks run once the inference server is up, before step 1.

Why a launcher step with a trainer mode: the launcher already holds the resolved configs and the
server's address, and may use the orchestrator's parts (tokenizer, samples, packing) and start
processes; the trainer's logprobs must come from the trainer itself (its blocks, kernels, mixed
precision and ranks are what training uses), so the launcher starts `tandem trainer-preflight` on the
trainer's devices and config. They meet in the wire format, like the run's processes: a probe batch
(`preflight/probe/rank_R.msgpack`) in, `preflight/trainer.json` out.

Steps: (1) a few two-turn probe conversations sampled by the server over HTTP, each turn re-rendered
by the chat template as the orchestrator does; (2) the prefix check: how often turn k's tokens are not
a prefix of turn k+1's prompt (each break starts a new sample, paying the context again); (3) the
trainer recomputes the probe's logprobs: the mismatch KL stops the run above
`preflight.max_mismatch_kl`, naming the likely cause; (4) the trainer's memory plan against its device,
the engine's share beside it; (5) an estimate of what the async overlap saves per step.
The result is printed as a table and saved as `preflight/report.{txt,json}`.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import httpx

from tandem.config.rl import RLConfig
from tandem.launch.process import ManagedProcess, RunFailed
from tandem.models.chat import render_chat
from tandem.models.loading import resolve_dtype
from tandem.orchestrator.packing import pack_step
from tandem.orchestrator.samples import Turn, build_samples
from tandem.orchestrator.server_dialect import dialect_of
from tandem.orchestrator.tokenizer import load_tokenizer
from tandem.transport.files import atomic_write_bytes, atomic_write_text
from tandem.transport.paths import preflight_dir, preflight_trainer_report, probe_file
from tandem.transport.types import encode_batch

PROBE_PROMPTS = ("Reverse the words: the quick brown fox.", "What is 12 times 7?", "Name three colors.",
                 "Write one short sentence about rivers.")
FOLLOW_UP = "Say it again, differently."


def sample_conversation(client: httpx.Client, base_url: str, tokenizer: Any, index: int, config: RLConfig) -> tuple[list[Turn], list[str]]:
    """Two model turns of one probe conversation, each prompt rendered from the whole conversation so far;
    also the problems the server's answers show (an echoed prompt that is not the one sent: a tokenizer mismatch)."""
    messages = [{"role": "user", "content": PROBE_PROMPTS[index % len(PROBE_PROMPTS)]}]
    temperature = config.orchestrator.sampling.temperature
    turns, problems = [], []
    for _ in range(2):
        prompt = render_chat(tokenizer, messages)
        body = {"prompt_token_ids": prompt, "max_tokens": config.preflight.max_tokens, "temperature": temperature,
                "seed": config.seed + index}
        dialect = dialect_of(config.inference.backend)
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


def probe(config: RLConfig, base_url: str) -> dict[str, Any]:
    """The probe conversations, sampled concurrently; their samples, prefix breaks and the server's tokens/s."""
    tokenizer = load_tokenizer(config.orchestrator.model)
    num = config.preflight.num_conversations
    headers = {"Authorization": f"Bearer {config.inference.server.api_key}"} if config.inference.server.api_key else {}
    start = time.perf_counter()
    with httpx.Client(timeout=config.orchestrator.client.timeout_s, headers=headers) as client, ThreadPoolExecutor(num) as pool:
        results = list(pool.map(lambda i: sample_conversation(client, base_url, tokenizer, i, config), range(num)))
    seconds = time.perf_counter() - start
    conversations = [turns for turns, _ in results]
    samples = [s for turns in conversations for s in build_samples(turns)]
    completion_tokens = sum(len(t.completion_ids) for turns in conversations for t in turns)
    return {"samples": samples, "pad_token_id": tokenizer.pad_token_id or 0,
            "problems": sorted({p for _, found in results for p in found}),
            "num_turns": sum(len(turns) for turns in conversations),
            "num_prefix_breaks": len(samples) - len(conversations),
            "completion_tokens": completion_tokens, "gen_tokens_per_s": completion_tokens / max(seconds, 1e-9)}


def write_probe(config: RLConfig, probed: dict[str, Any]) -> None:
    """The probe's samples packed for the trainer's ranks as the orchestrator packs a step (step 0)."""
    batches, _ = pack_step(0, probed["samples"], config.seq_len, config.deployment.num_trainer_ranks, probed["pad_token_id"])
    for batch in batches:
        atomic_write_bytes(probe_file(config.run_dir, batch.rank), encode_batch(batch))


def likely_causes(config: RLConfig, probed: dict[str, Any], trainer: dict[str, Any]) -> list[str]:
    """What, from the configs and the probe, can make the trainer disagree with the server."""
    engine = config.inference.engine.device
    engine_dtype = str(resolve_dtype(config.inference.model.dtype, "cpu" if engine == "auto" else engine)).removeprefix("torch.")
    causes = []
    if engine_dtype != trainer["dtype"]:
        causes.append(f"dtype: the server computes in {engine_dtype}, the trainer in {trainer['dtype']} "
                      "(set the same `model.dtype` in `[inference]` and `[trainer]`)")
    causes += [f"tokenizer: {p}" for p in probed["problems"]]
    if probed["num_prefix_breaks"]:
        causes.append(f"chat template: {probed['num_prefix_breaks']} of {probed['num_turns']} turns do not extend the "
                      "previous turn's tokens (a template that rewrites history)")
    if config.inference.model.name != config.trainer.model.name:
        causes.append(f"weights: the server loads {config.inference.model.name}, the trainer {config.trainer.model.name}")
    return causes or ["kernels or weights: dtypes, tokens and template agree, so the two forwards compute different "
                      "policies (a model that falls back to transformers, or weights that differ)"]


def engine_share(config: RLConfig, memory: dict[str, Any]) -> float | None:
    """GiB the engine may take on the trainer's device: on a shared GPU its fraction, on the CPU its KV cache."""
    if config.deployment.type == "cpu":
        return config.inference.engine.cpu_kv_cache_gib
    if config.deployment.shares_a_gpu:
        return config.inference.engine.memory_fraction * memory["device_total"]
    return None


def overlap_estimate(config: RLConfig, probed: dict[str, Any], trainer: dict[str, Any]) -> dict[str, float]:
    """Seconds per step for `batch_size` samples of the probe's shape, with and without the async overlap.
    The server's rate is measured at the probe's concurrency, lower than a full batch's: t_gen is an upper bound."""
    samples = probed["samples"]
    per_sample = config.orchestrator.batch_size / max(len(samples), 1)
    t_gen = per_sample * probed["completion_tokens"] / probed["gen_tokens_per_s"]
    t_train = per_sample * sum(len(s) for s in samples) / trainer["train_tokens_per_s"]
    asynchronous = max(t_gen, t_train) if config.orchestrator.max_async_level > 0 else t_gen + t_train
    return {"t_generate_s": t_gen, "t_train_s": t_train, "step_sync_s": t_gen + t_train, "step_async_s": asynchronous,
            "overlap_saving": 1 - asynchronous / (t_gen + t_train)}


def build_report(config: RLConfig, probed: dict[str, Any], trainer: dict[str, Any]) -> dict[str, Any]:
    memory = dict(trainer["memory"])
    memory["engine_share"] = engine_share(config, memory)
    memory["fits"] = (memory.get("planned", 0) + (memory["engine_share"] or 0)) <= memory["device_total"]
    kl = trainer["mismatch_kl"]
    return {"mismatch_kl": kl, "max_mismatch_kl": config.preflight.max_mismatch_kl,
            "kl_ok": kl is not None and kl <= config.preflight.max_mismatch_kl,
            "likely_causes": likely_causes(config, probed, trainer), "num_turns": probed["num_turns"],
            "num_prefix_breaks": probed["num_prefix_breaks"], "num_loss_tokens": trainer["num_loss_tokens"],
            "trainer_dtype": trainer["dtype"], "trainer_device": trainer["device"], "memory_gib": memory,
            "gen_tokens_per_s": probed["gen_tokens_per_s"], "train_tokens_per_s": trainer["train_tokens_per_s"],
            "overlap": overlap_estimate(config, probed, trainer)}


def format_report(report: dict[str, Any]) -> str:
    def num(v: Any) -> str:
        return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)

    mem, overlap = report["memory_gib"], report["overlap"]
    rows = [("mismatch KL (probe)", f"{num(report['mismatch_kl'])} (limit {num(report['max_mismatch_kl'])}, "
                                    f"{report['num_loss_tokens']} tokens, {report['trainer_dtype']})"),
            ("chat-template prefix breaks", f"{report['num_prefix_breaks']} of {report['num_turns']} turns"),
            *((f"memory: {k} (GiB)", num(mem.get(k))) for k in ("weights", "gradients", "optimizer", "activations",
                                                                 "process_peak", "engine_share", "device_total")),
            ("memory fits", str(mem["fits"])),
            ("tokens/s: server, trainer", f"{num(report['gen_tokens_per_s'])}, {num(report['train_tokens_per_s'])}"),
            ("step s: generate, train", f"{num(overlap['t_generate_s'])}, {num(overlap['t_train_s'])}"),
            ("step s: sync, async", f"{num(overlap['step_sync_s'])}, {num(overlap['step_async_s'])} "
                                    f"(overlap saves {overlap['overlap_saving']:.0%})")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def run_preflight(config: RLConfig, base_url: str, start_trainer: Callable[[], ManagedProcess]) -> dict[str, Any]:
    """Probe, trainer mode, report; RunFailed when the trainer disagrees with the server."""
    folder = preflight_dir(config.run_dir)
    probed = probe(config, base_url)
    write_probe(config, probed)
    trainer = start_trainer()
    if trainer.wait() != 0:
        tail = "\n".join(f"  | {line}" for line in trainer.tail(20))
        raise RunFailed(f"the trainer's preflight failed (exit code {trainer.poll()}); last lines of {trainer.log_path}:\n{tail}")
    report = build_report(config, probed, json.loads(preflight_trainer_report(config.run_dir).read_text()))
    text = format_report(report)
    atomic_write_text(folder / "report.json", json.dumps(report, indent=1))
    atomic_write_text(folder / "report.txt", text + "\n")
    print(text, flush=True)
    if not report["kl_ok"]:
        raise RunFailed(f"preflight: mismatch KL {report['mismatch_kl']} on the probe batch is above "
                        f"`preflight.max_mismatch_kl` = {config.preflight.max_mismatch_kl}: trainer and server disagree "
                        "on the policy. Likely cause: " + "; ".join(report["likely_causes"]))
    return report
