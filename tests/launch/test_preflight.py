"""The preflight of `tandem rl` on the CPU with the tiny model: a real server over HTTP, the real trainer
preflight process, real files; mismatch KL, the chat-template prefix check, the memory plan, the report."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tandem.config.resolve import parse_rl_args
from tandem.inference.server import BackgroundServer
from tandem.launch import preflight as preflight_module
from tandem.launch.preflight import run_preflight
from tandem.launch.process import ManagedProcess, RunFailed
from tandem.launch.rl import _child_env, _commands, _write_process_configs
from tandem.models.presets import init_model
from tandem.transport.paths import preflight_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return init_model("tiny", tmp_path_factory.mktemp("models") / "tiny", seed=0)


def preflight(tiny, out, *extra):
    """The launcher's preflight step against a server built from the run's inference config."""
    config = parse_rl_args(["--model.name", str(tiny), "--output-dir", str(out), "--seq-len", "256",
                            "--orchestrator.batch-size", "8", "--orchestrator.group-size", "4", *extra], environ={})
    (out / "configs").mkdir(parents=True)
    (out / "logs").mkdir()
    argv, devices = _commands(config, _write_process_configs(config))["trainer-preflight"]
    server = BackgroundServer(config.inference)
    try:
        return run_preflight(config, server.url, lambda: ManagedProcess("preflight", argv, out / "logs" / "preflight.log",
                                                                         _child_env(devices)))
    finally:
        server.stop()


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


def with_tokenizer(monkeypatch, drop_history: bool) -> None:
    real = preflight_module.load_tokenizer
    monkeypatch.setattr(preflight_module, "load_tokenizer", lambda model: FaithfulText(real(model), drop_history))


def test_matching_engine_and_trainer_pass_with_a_plan_and_a_table(tiny, tmp_path, monkeypatch, capsys):
    with_tokenizer(monkeypatch, drop_history=False)
    report = preflight(tiny, tmp_path)
    # fp32 on both sides: the engine's paged attention and the trainer's SDPA round differently, but barely.
    assert report["kl_ok"] and 0 <= report["mismatch_kl"] < 1e-7
    assert report["num_turns"] == 8 and report["num_prefix_breaks"] == 0
    memory = report["memory_gib"]
    assert memory["weights"] > 0 and memory["optimizer"] == pytest.approx(2 * memory["weights"])  # AdamW, fp32
    assert memory["engine_share"] == 1.0 and memory["fits"] and memory["device_total"] > memory["process_peak"] > 0
    overlap = report["overlap"]
    assert overlap["step_async_s"] == pytest.approx(max(overlap["t_generate_s"], overlap["t_train_s"]))
    saved = preflight_dir(tmp_path)
    assert json.loads((saved / "report.json").read_text())["mismatch_kl"] == report["mismatch_kl"]
    assert "chat-template prefix breaks  0 of 8 turns" in (saved / "report.txt").read_text()
    assert "mismatch KL (probe)" in capsys.readouterr().out


def test_a_template_that_rewrites_history_is_counted(tiny, tmp_path, monkeypatch):
    with_tokenizer(monkeypatch, drop_history=True)
    report = preflight(tiny, tmp_path, "--preflight.num-conversations", "2")
    assert report["num_turns"] == 4 and report["num_prefix_breaks"] == 2
    assert any(c.startswith("chat template: 2 of 4 turns") for c in report["likely_causes"])


def test_a_dtype_mismatch_stops_the_run_naming_it(tiny, tmp_path):
    with pytest.raises(RunFailed) as failed:
        preflight(tiny, tmp_path, "--inference.model.dtype", "bfloat16", "--preflight.max-mismatch-kl", "1e-7",
                  "--preflight.num-conversations", "2")
    assert "`preflight.max_mismatch_kl` = 1e-07" in str(failed.value)
    assert "dtype: the server computes in bfloat16, the trainer in float32" in str(failed.value)
    assert not json.loads((preflight_dir(tmp_path) / "report.json").read_text())["kl_ok"]


@pytest.mark.slow
def test_preflight_only_runs_the_checks_and_nothing_else(tiny, tmp_path):
    """`tandem rl --preflight-only`: the real launcher, server and trainer processes; no step is trained."""
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    done = subprocess.run([sys.executable, "-m", "tandem.cli", "rl", "--model.name", str(tiny), "--output-dir", str(out),
                           "--preflight-only", "--seq-len", "256", "--orchestrator.batch-size", "8",
                           "--orchestrator.group-size", "4", "--inference.server.port", "0"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "mismatch KL (probe)" in done.stdout and (preflight_dir(out) / "report.json").is_file()
    assert not (out / "metrics.jsonl").exists() and not (out / "rollouts").exists()
