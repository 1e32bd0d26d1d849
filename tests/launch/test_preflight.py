"""The preflight of `tandem rl` on the CPU with the tiny model: a real server over HTTP, the real orchestrator
and trainer preflight processes, real files; mismatch KL, the chat-template prefix check, the memory plan, the report."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
from short_runs import env

from tandem.config.resolve import parse_rl_args
from tandem.inference.server import BackgroundServer
from tandem.launch.preflight import MismatchLimit, build_report, format_report, likely_causes, mismatch_limit
from tandem.launch.process import RunFailed
from tandem.launch.rl import _commands, _preflight, _write_process_configs
from tandem.models.presets import init_model
from tandem.orchestrator.preflight import probe, write_probe
from tandem.orchestrator.tokenizer import load_tokenizer
from tandem.transport.paths import preflight_dir, probe_file
from tandem.transport.types import decode_batch


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return init_model("tiny", tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture(scope="module")
def preflight_only(tiny, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """`tandem rl --preflight-only`: the real launcher, server and preflight processes; what it printed and its run
    folder. One run serves the test of what it leaves and the test of its report, since a run's start costs more
    than its checks."""
    out = tmp_path_factory.mktemp("preflight-only") / "run"
    done = subprocess.run([sys.executable, "-m", "tandem.cli", "rl", "--model.name", str(tiny), "--output-dir", str(out),
                           "--preflight-only", "--seq-len", "256", "--orchestrator.batch-size", "8",
                           "--orchestrator.group-size", "4", "--inference.server.port", "0"],
                          env=env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done, out


@contextmanager
def served(tiny, out, *extra):
    """A server built from the run's inference config, and the run's config resolved with the server's port."""
    args = ["--model.name", str(tiny), "--output-dir", str(out), "--seq-len", "256", "--orchestrator.batch-size", "8",
            "--orchestrator.group-size", "4", *extra]
    server = BackgroundServer(parse_rl_args(args, environ={}).inference)
    try:
        yield parse_rl_args([*args, "--inference.server.port", str(server.port)], environ={})
    finally:
        server.stop()


def preflight(tiny, out, *extra):
    """The launcher's preflight step (its processes, their files, the report) against a real server."""
    with served(tiny, out, *extra) as config:
        _preflight(config, _commands(config, _write_process_configs(config)))
    return json.loads((preflight_dir(out) / "report.json").read_text())


class FaithfulText:
    """The tiny tokenizer with a text form of completions that encodes back to the very ids (`[id]` per token):
    the random tiny model writes invalid bytes, which no real tokenizer round-trips. `drop_history`: a template
    that drops earlier assistant turns, as some reasoning templates do."""

    def __init__(self, inner, drop_history: bool):
        self.inner, self.drop_history = inner, drop_history
        self.chat_template, self.pad_token_id = inner.chat_template, inner.pad_token_id

    def decode(self, ids, **kwargs):
        return "".join(f"[{i}]" for i in ids)

    def encode(self, text, **kwargs):
        parts = re.split(r"\[(\d+)\]", text)
        return [i for k, part in enumerate(parts) for i in ([int(part)] if k % 2 else self.inner.encode(part, **kwargs))]

    def apply_chat_template(self, messages, **kwargs):
        last = len(messages) - 1
        kept = [m for i, m in enumerate(messages) if not (self.drop_history and m["role"] == "assistant" and i < last)]
        return self.inner.apply_chat_template(kept, **kwargs)


@pytest.mark.slow
def test_matching_engine_and_trainer_pass_with_a_plan_and_a_table(preflight_only):
    done, out = preflight_only
    report = json.loads((preflight_dir(out) / "report.json").read_text())
    # fp32 on both sides: the engine's paged attention and the trainer's SDPA round differently, but barely.
    assert report["kl_ok"] and 0 <= report["mismatch_kl"] < 1e-7
    assert report["num_turns"] == 8 and report["num_loss_tokens"] > 0
    memory = report["memory_gib"]
    assert memory["weights"] > 0 and memory["optimizer"] == pytest.approx(2 * memory["weights"])  # AdamW, fp32
    assert memory["engine_share"] == 1.0 and memory["fits"] and memory["device_total"] > memory["process_peak"] > 0
    overlap = report["overlap"]
    assert overlap["step_async_s"] == pytest.approx(max(overlap["t_generate_s"], overlap["t_train_s"]))
    saved = preflight_dir(out)
    assert f"chat-template prefix breaks  {report['num_prefix_breaks']} of 8 turns" in (saved / "report.txt").read_text()
    assert "mismatch KL (probe)" in done.stdout
    assert json.loads((saved / "orchestrator.json").read_text())["num_turns"] == 8


def probe_with(tiny, out, drop_history: bool, *extra):
    """The orchestrator preflight's probe in this process, against a real server, with a tokenizer that
    round-trips the tiny model's completions (and, with `drop_history`, a template that rewrites history)."""
    with served(tiny, out, *extra) as config:
        samples, findings = probe(config.orchestrator, FaithfulText(load_tokenizer(config.orchestrator.model), drop_history))
        write_probe(config.orchestrator, samples, 0)
    return config, findings


def test_a_template_that_keeps_history_makes_one_sample_per_conversation_packed_for_the_trainer(tiny, tmp_path):
    _, findings = probe_with(tiny, tmp_path, False, "--deployment.num-trainer-processes", "2")
    assert findings["num_turns"] == 8 and findings["num_prefix_breaks"] == 0 and findings["num_samples"] == 4
    assert findings["problems"] == [] and findings["gen_tokens_per_s"] > 0
    batches = [decode_batch(probe_file(tmp_path, rank).read_bytes()) for rank in range(2)]
    # every sampled token once, over both ranks' rows; each rank's file carries the global count
    assert sum(sum(row.loss_mask) for b in batches for row in b.rows) == findings["completion_tokens"]
    assert [b.num_loss_tokens for b in batches] == [findings["completion_tokens"]] * 2


def test_a_template_that_rewrites_history_is_counted(tiny, tmp_path):
    config, findings = probe_with(tiny, tmp_path, True, "--preflight.num-conversations", "2")
    assert findings["num_turns"] == 4 and findings["num_prefix_breaks"] == 2 and findings["num_samples"] == 4
    causes = likely_causes(config, findings, {"dtype": "float32"})
    assert any(c.startswith("chat template: 2 of 4 turns") for c in causes)


def test_a_dtype_mismatch_stops_the_run_naming_it(tiny, tmp_path):
    with pytest.raises(RunFailed) as failed:
        preflight(tiny, tmp_path, "--inference.model.dtype", "bfloat16", "--preflight.max-mismatch-kl", "1e-7",
                  "--preflight.num-conversations", "2")
    assert "`preflight.max_mismatch_kl` = 1e-07" in str(failed.value)
    assert "dtype: the server computes in bfloat16, the trainer in float32" in str(failed.value)
    assert not json.loads((preflight_dir(tmp_path) / "report.json").read_text())["kl_ok"]


def test_a_server_that_does_not_answer_stops_the_orchestrator_preflight_naming_it(tiny, tmp_path):
    with served(tiny, tmp_path) as config:
        pass  # stopped: its port now refuses connections
    with pytest.raises(RunFailed) as failed:
        _preflight(config, _commands(config, _write_process_configs(config)))
    assert "`tandem orchestrator-preflight` failed (exit code 1)" in str(failed.value)
    assert config.orchestrator.client.base_urls[0] in str(failed.value)
    assert not (preflight_dir(tmp_path) / "trainer.json").exists()


def test_preflight_only_runs_the_checks_and_nothing_else(preflight_only):
    """`tandem rl --preflight-only`: the checks ran (their report), and no step is trained."""
    done, out = preflight_only
    assert "mismatch KL (probe)" in done.stdout and (preflight_dir(out) / "report.json").is_file()
    assert not (out / "metrics.jsonl").exists() and not (out / "rollouts").exists()


PROBED = {"problems": [], "num_prefix_breaks": 0, "num_turns": 8, "num_samples": 4, "completion_tokens": 64,
          "gen_tokens_per_s": 100.0, "num_sample_tokens": 128}
"""What the orchestrator's preflight finds on a probe that tokenizes and renders as the trainer does."""


def findings(kl: float) -> dict:
    """The trainer preflight's findings, with mismatch KL `kl`, the engine's dtype and room to spare."""
    return {"mismatch_kl": kl, "dtype": "float32", "device": "cpu", "num_loss_tokens": 64, "train_tokens_per_s": 100.0,
            "memory": {"planned": 1.0, "device_total": 64.0}}


@pytest.mark.parametrize("fp8", [(), ("quantization",), ("kv_cache_dtype",), ("quantization", "kv_cache_dtype")])
def test_fp8_rollouts_answer_to_their_own_mismatch_limit_and_the_report_says_which(tiny, tmp_path, fp8):
    """A KL between the two limits stops a run whose server computes as the trainer does, and passes one whose
    server rounds to FP8; the report and the failure name the key that applied and why."""
    switches = [arg for key in fp8 for arg in (f"--inference.engine.{key}", "fp8")]
    config = parse_rl_args(["--model.name", str(tiny), "--output-dir", str(tmp_path), *switches], environ={})
    limit = mismatch_limit(config)
    if fp8:
        assert limit == MismatchLimit(1e-2, "preflight.max_mismatch_kl_fp8", "the server rounds to FP8: " + " and ".join(
            f"`inference.engine.{key}` = 'fp8'" for key in fp8))
    else:
        assert limit == MismatchLimit(1e-3, "preflight.max_mismatch_kl", "the server does not round to FP8")
    between = build_report(config, PROBED, findings(5e-3))
    assert between["kl_ok"] == bool(fp8) and between["max_mismatch_kl"] == limit.value
    assert f"`{limit.key}`: {limit.reason}" in format_report(between)
    assert build_report(config, PROBED, findings(limit.value))["kl_ok"]
    assert not build_report(config, PROBED, findings(1.01 * limit.value))["kl_ok"]
    causes = likely_causes(config, PROBED, findings(1.0))
    assert any(c.startswith("FP8 rollouts") for c in causes) == bool(fp8)


def test_each_limit_is_its_own_key(tiny, tmp_path):
    args = ["--model.name", str(tiny), "--output-dir", str(tmp_path), "--preflight.max-mismatch-kl", "2e-4",
            "--preflight.max-mismatch-kl-fp8", "3e-2"]
    assert mismatch_limit(parse_rl_args(args, environ={})).value == 2e-4
    assert mismatch_limit(parse_rl_args([*args, "--inference.engine.kv-cache-dtype", "fp8"], environ={})).value == 3e-2
