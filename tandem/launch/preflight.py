"""The preflight of `tandem rl`: checks run once the inference server is up, before step 1.

Each side runs as its own process on its own resolved config, as in the run, so that the probe is what the
orchestrator would sample and pack and its logprobs what the trainer would compute (its blocks, kernels, mixed
precision and ranks). They meet in the wire format like the run's processes: `tandem orchestrator-preflight`
writes a probe batch (`preflight/probe/rank_R.msgpack`) that `tandem trainer-preflight`, on the trainer's
devices, recomputes; each leaves its findings as JSON (`preflight/orchestrator.json`, `preflight/trainer.json`),
from which, with the RL config, this module builds the report.

Steps: (1) a few two-turn probe conversations sampled by the server over HTTP, each turn re-rendered
by the chat template as the orchestrator does; (2) the prefix check: how often turn k's tokens are not
a prefix of turn k+1's prompt (each break starts a new sample, paying the context again); (3) the
trainer recomputes the probe's logprobs: the mismatch KL stops the run above its limit
(`mismatch_limit`: `preflight.max_mismatch_kl`, or `preflight.max_mismatch_kl_fp8` for a server that rounds to FP8),
naming the likely cause; (4) the trainer's memory plan against its device,
the engine's share beside it; (5) an estimate of what the async overlap saves per step.
The result is printed as a table and saved as `preflight/report.{txt,json}`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from tandem.config.rl import RLConfig
from tandem.launch.process import ManagedProcess, RunFailed
from tandem.models.loading import resolve_dtype
from tandem.transport.files import atomic_write_text
from tandem.transport.paths import preflight_dir, preflight_orchestrator_report, preflight_trainer_report

PROCESSES = ("orchestrator-preflight", "trainer-preflight")
"""The preflight's processes, in order (`tandem <name>`): the trainer reads the orchestrator's probe batch."""


@dataclass(frozen=True)
class MismatchLimit:
    """The mismatch KL above which the preflight stops the run, the key that set it, and why that key applies."""

    value: float
    key: str
    reason: str


def fp8_switches(config: RLConfig) -> list[str]:
    """The engine's FP8 settings that are on, as `key` = 'fp8'."""
    engine = config.inference.engine
    return [f"`inference.engine.{key}` = 'fp8'" for key, value in
            (("quantization", engine.quantization), ("kv_cache_dtype", engine.kv_cache_dtype)) if value == "fp8"]


def mismatch_limit(config: RLConfig) -> MismatchLimit:
    """FP8 rollouts differ from the trainer's logprobs by FP8's rounding, on purpose (the loss corrects for it): they
    answer to `preflight.max_mismatch_kl_fp8`. Any other server computes what the trainer computes, up to the order
    of its sums: `preflight.max_mismatch_kl`."""
    switches = fp8_switches(config)
    if switches:
        return MismatchLimit(config.preflight.max_mismatch_kl_fp8, "preflight.max_mismatch_kl_fp8",
                             f"the server rounds to FP8: {' and '.join(switches)}")
    return MismatchLimit(config.preflight.max_mismatch_kl, "preflight.max_mismatch_kl", "the server does not round to FP8")


def likely_causes(config: RLConfig, probed: dict[str, Any], trainer: dict[str, Any]) -> list[str]:
    """What, from the configs and the probe, can make the trainer disagree with the server."""
    engine = config.inference.engine.device
    engine_dtype = str(resolve_dtype(config.inference.model.dtype, "cpu" if engine == "auto" else engine)).removeprefix("torch.")
    switches = fp8_switches(config)
    causes = [f"FP8 rollouts ({' and '.join(switches)}): part of the gap is FP8's rounding; if nothing else here applies, "
              "raise `preflight.max_mismatch_kl_fp8` and pair the run with the loss settings of docs/trainer.md "
              "(\"FP8 rollouts\"), or turn FP8 off"] if switches else []
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
    per_sample = config.orchestrator.batch_size / max(probed["num_samples"], 1)
    t_gen = per_sample * probed["completion_tokens"] / probed["gen_tokens_per_s"]
    t_train = per_sample * probed["num_sample_tokens"] / trainer["train_tokens_per_s"]
    asynchronous = max(t_gen, t_train) if config.orchestrator.max_async_level > 0 else t_gen + t_train
    return {"t_generate_s": t_gen, "t_train_s": t_train, "step_sync_s": t_gen + t_train, "step_async_s": asynchronous,
            "overlap_saving": 1 - asynchronous / (t_gen + t_train)}


def build_report(config: RLConfig, probed: dict[str, Any], trainer: dict[str, Any]) -> dict[str, Any]:
    memory = dict(trainer["memory"])
    memory["engine_share"] = engine_share(config, memory)
    memory["fits"] = (memory.get("planned", 0) + (memory["engine_share"] or 0)) <= memory["device_total"]
    kl, limit = trainer["mismatch_kl"], mismatch_limit(config)
    return {"mismatch_kl": kl, "max_mismatch_kl": limit.value, "mismatch_limit_key": limit.key,
            "mismatch_limit_reason": limit.reason, "kl_ok": kl is not None and kl <= limit.value,
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
            ("mismatch KL limit", f"`{report['mismatch_limit_key']}`: {report['mismatch_limit_reason']}"),
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


def run_preflight(config: RLConfig, start: Callable[[str], ManagedProcess]) -> dict[str, Any]:
    """Each of `PROCESSES`, started by `start(name)`, to its end; then the report. RunFailed when a process
    fails or the trainer disagrees with the server."""
    folder = preflight_dir(config.run_dir)
    for name in PROCESSES:
        proc = start(name)
        if proc.wait() != 0:
            tail = "\n".join(f"  | {line}" for line in proc.tail(20))
            raise RunFailed(f"`tandem {name}` failed (exit code {proc.poll()}); last lines of {proc.log_path}:\n{tail}")
    probed = json.loads(preflight_orchestrator_report(config.run_dir).read_text())
    report = build_report(config, probed, json.loads(preflight_trainer_report(config.run_dir).read_text()))
    text = format_report(report)
    atomic_write_text(folder / "report.json", json.dumps(report, indent=1))
    atomic_write_text(folder / "report.txt", text + "\n")
    print(text, flush=True)
    if not report["kl_ok"]:
        raise RunFailed(f"preflight: mismatch KL {report['mismatch_kl']} on the probe batch is above "
                        f"`{report['mismatch_limit_key']}` = {report['max_mismatch_kl']} ({report['mismatch_limit_reason']}): "
                        "trainer and server disagree on the policy. Likely cause: " + "; ".join(report["likely_causes"]))
    return report
