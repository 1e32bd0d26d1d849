"""Failure injection on the CPU: finished work is never overwritten, and every phase stops cleanly.

Run folders (`tandem/config/run_folder.py`): a folder that holds a run is written only when the command is told
to (`--resume` or `--clean`; `tandem sft`: `--ckpt.resume`), the SFT warm-up's folder included, which is reused
when finished, continued from its checkpoint, or refused by name, all before any process starts; a model folder
that does not exist is a config error (exit 2, nothing written). Signals: SIGINT and SIGTERM sent to each phase
(the warm-up, `tandem sft`, `tandem eval`, the preflight, the RL run) once its log shows it started end it with
one line, `tandem <command>: stopped by SIG...`, and exit code 1: no traceback, no process of it left. Flags: a
boolean flag followed by `@ file` is the flag, then the file.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from short_runs import REPO, env, rl_command

from tandem.config.loader import parse_args
from tandem.config.resolve import parse_rl_args
from tandem.config.rl import RLConfig
from tandem.config.run_folder import RUN_PARTS, remove_run
from tandem.config.sft import SFTConfig
from tandem.launch.process import RunFailed
from tandem.launch.warmup import WarmupPlan, plan_warmup, run_warmup
from tandem.models.presets import init_model
from tandem.monitor.metrics import read_metrics
from tandem.monitor.stop_signals import held_signals, stops_cleanly
from tandem.transport.paths import STABLE, checkpoint_dir, final_weights_dir, weights_dir

EXAMPLE_RL = str(REPO / "examples" / "reverse_text" / "rl.toml")
SIGNALS = [signal.SIGINT, signal.SIGTERM]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return init_model("tiny", tmp_path_factory.mktemp("model") / "tiny", seed=0)


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "tandem.cli", *args]


def run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)


def sft_toml(root: Path, max_steps: int, **extra: str) -> Path:
    """An SFT config of the tiny task under `root`: base model `base/`, data `data/train.jsonl`, output `sft/`."""
    lines = [f'model.name = "{root / "base"}"', f'output_dir = "{root / "sft"}"', "seq_len = 128",
             f"max_steps = {max_steps}", *(f"{k} = {v}" for k, v in extra.items()),
             "[data]", f'path = "{root / "data" / "train.jsonl"}"', "rows_per_step = 2",
             "[parallel.activation_checkpoint]", 'mode = "off"']
    path = root / "sft.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def fake_sft_run(folder: Path, steps: int, finished: bool, checkpoint: int | None = None) -> None:
    """The records an SFT run leaves after `steps` steps: metrics rows, `weights/step_<steps>`, and, `finished`,
    `weights/final`; `checkpoint`: a complete trainer checkpoint of that step."""
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "process": "sft", "loss": 1.0}) + "\n"
                                                  for s in range(1, steps + 1)))
    weights_dir(folder, steps).mkdir(parents=True)
    (weights_dir(folder, steps) / STABLE).touch()
    if finished:
        final_weights_dir(folder).symlink_to(f"step_{steps}")
    if checkpoint is not None:
        checkpoint_dir(folder, checkpoint, "trainer").mkdir(parents=True)
        (checkpoint_dir(folder, checkpoint, "trainer") / "state.pt").touch()


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under `folder` with its size and modification time: what 'untouched' means."""
    return {str(p.relative_to(folder)): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in folder.rglob("*")}


# ---- finished work is never overwritten ----


def test_a_missing_model_folder_is_a_config_error_before_anything_is_written(tmp_path):
    out = tmp_path / "run"
    result = run(cli("rl", "--model.name", str(tmp_path / "nope"), "--output-dir", str(out)))
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"config error: `model.name` = '{tmp_path / 'nope'}' is no folder and no hub name" in result.stderr
    assert not out.exists()


def refused_warm_up(tmp_path: Path, model_leaf: str, sft_max_steps: int, code: int) -> str:
    """Run `tandem rl` from `sft/weights/<model_leaf>` with the warm-up `sft_toml(tmp_path, sft_max_steps)`: it must
    exit with `code`, leave the SFT folder as it was, and make no run folder; its stderr."""
    before = snapshot(tmp_path / "sft")
    out = tmp_path / "rl"
    result = run(cli("rl", "@", EXAMPLE_RL, "--model.name", str(tmp_path / "sft" / "weights" / model_leaf),
                     "--warmup.sft", str(sft_toml(tmp_path, sft_max_steps)), "--output-dir", str(out)))
    assert result.returncode == code, result.stderr[-2000:]
    assert snapshot(tmp_path / "sft") == before and not out.exists()
    return result.stderr


def test_a_mistyped_model_name_never_reruns_a_finished_warm_up(tmp_path):
    """The warm-up's result is `weights/final`: a `model.name` beside it is refused at resolution, and the finished
    SFT run is left as it was (it was run again into the same folder, appending to its records)."""
    fake_sft_run(tmp_path / "sft", steps=6, finished=True)
    stderr = refused_warm_up(tmp_path, "finall", 6, code=2)
    assert f"does not write it: its result is {tmp_path / 'sft' / 'weights' / 'final'}" in stderr


def test_an_unfinished_warm_up_without_a_checkpoint_is_refused_by_name(tmp_path):
    fake_sft_run(tmp_path / "sft", steps=5, finished=False)
    stderr = refused_warm_up(tmp_path, "final", 40, code=1)
    assert (f"the warm-up's SFT folder {tmp_path / 'sft'} holds an unfinished run (step 5 of 40, no complete checkpoint "
            "to continue from): pass --clean") in stderr


def test_the_warm_up_reuses_continues_starts_or_refuses_its_folder(tmp_path):
    def plan(*extra: str, model_leaf: str = "final") -> WarmupPlan | None:
        return plan_warmup(parse_rl_args(["--model.name", str(tmp_path / "sft" / "weights" / model_leaf), "--warmup.sft",
                                          str(sft_toml(tmp_path, 40)), "--output-dir", str(tmp_path / "rl"), *extra], environ={}))

    fresh = plan()
    assert (fresh.resume_step, fresh.start_over) == (None, False)  # nothing there yet: the SFT starts at step 0
    fake_sft_run(tmp_path / "sft", steps=5, finished=False, checkpoint=4)
    assert plan().resume_step == 4  # continued from its newest complete checkpoint
    (checkpoint_dir(tmp_path / "sft", 4, "trainer") / "state.pt").unlink()
    assert plan("--clean").start_over
    with pytest.raises(RunFailed, match="holds an unfinished run"):
        plan()
    final_weights_dir(tmp_path / "sft").symlink_to("step_5")
    assert plan() is None  # finished: its result is the starting model, which exists
    with pytest.raises(RunFailed, match="has finished without writing the starting model .*step_40"):
        plan(model_leaf="step_40")  # its config asks for more steps now: finished all the same, never run again


def test_tandem_sft_writes_only_into_a_folder_it_is_told_to(model, tmp_path, caplog, monkeypatch):
    from tandem.monitor.logging import setup_logging
    from tandem.trainer.sft.train import main as sft_main

    monkeypatch.setattr(setup_logging("sft").parent, "propagate", True)  # let caplog see tandem's records

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text(json.dumps({"prompt": "abc", "completion": "cba"}) + "\n")
    (tmp_path / "base").symlink_to(model)
    toml = sft_toml(tmp_path, 1, device='"cpu"')

    def sft(*flags: str) -> int:
        return sft_main(parse_args(SFTConfig, ["@", str(toml), *flags], environ={}))

    assert sft() == 0
    with caplog.at_level(logging.ERROR, logger="tandem.sft"):
        assert sft() == 1
    assert f"{tmp_path / 'sft'} already holds a run (metrics.jsonl, weights): pass --ckpt.resume" in caplog.text
    assert [r["step"] for r in read_metrics(tmp_path / "sft", "sft")] == [1]  # the refused run wrote nothing
    (tmp_path / "sft" / "notes.txt").write_text("mine")
    assert sft("--clean") == 0
    assert [r["step"] for r in read_metrics(tmp_path / "sft", "sft")] == [1]  # one run's rows, not two
    assert (tmp_path / "sft" / "notes.txt").read_text() == "mine"  # what is not a run's is left alone


def test_clean_removes_every_part_of_a_run_and_eval_records_are_a_run(model, tmp_path):
    out = tmp_path / "run"
    for part in RUN_PARTS:
        is_file = part in ("metrics.jsonl", "report.html")
        (out / part).parent.mkdir(parents=True, exist_ok=True) if is_file else (out / part).mkdir(parents=True)
        (out / part if is_file else out / part / "x").touch()
    (out / "notes.txt").touch()
    remove_run(out)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    (out / "eval" / "step_0").mkdir(parents=True)  # `tandem eval` of a folder: its records make it hold a run
    result = run(rl_command(model, out, 2))
    assert result.returncode == 1 and f"{out} already holds a run (eval); pass --resume" in result.stderr


@pytest.mark.slow
def test_an_unfinished_warm_up_is_continued_from_its_checkpoint_and_each_step_recorded_once(model, tmp_path):
    """A warm-up stopped after step 3 with its newest checkpoint at step 2: the next run removes step 3's records
    and continues from step 2, so that each step has one row, as in a warm-up that never stopped."""
    from tandem.trainer.sft.train import main as sft_main

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("".join(json.dumps({"prompt": w, "completion": w[::-1]}) + "\n"
                                                           for w in ("abc", "hello", "tandem", "stop")))
    (tmp_path / "base").symlink_to(model)
    toml = sft_toml(tmp_path, 3, device='"cpu"', **{"ckpt.enabled": "true", "ckpt.interval": "2"})
    assert sft_main(parse_args(SFTConfig, ["@", str(toml)], environ={})) == 0
    final_weights_dir(tmp_path / "sft").unlink()  # stopped after step 3's records, before its checkpoint was complete
    (checkpoint_dir(tmp_path / "sft", 3, "trainer") / "state.pt").unlink()
    toml = sft_toml(tmp_path, 4, device='"cpu"', **{"ckpt.enabled": "true", "ckpt.interval": "2"})
    config: RLConfig = parse_rl_args(["@", EXAMPLE_RL, "--model.name", str(tmp_path / "sft" / "weights" / "final"),
                                      "--warmup.sft", str(toml), "--output-dir", str(tmp_path / "rl")], environ={})
    plan = plan_warmup(config)
    assert plan.resume_step == 2
    run_warmup(config, plan, logging.getLogger("tandem.launch"))
    assert [r["step"] for r in read_metrics(tmp_path / "sft", "sft")] == [1, 2, 3, 4]
    assert final_weights_dir(tmp_path / "sft").resolve() == weights_dir(tmp_path / "sft", 4).resolve()
    assert "resumed from" in (tmp_path / "rl" / "logs" / "sft.log").read_text()


# ---- a boolean flag never takes the file after it ----


@pytest.mark.parametrize("flag, value", [(["--resume"], True), (["--resume", "true"], True), (["--resume=true"], True),
                                         (["--resume", "false"], False), (["--no-resume"], False),
                                         (["--preflight.enabled"], True), (["--no-preflight.enabled"], False)])
@pytest.mark.parametrize("attached", [False, True])
def test_a_boolean_flag_is_followed_by_a_file_not_its_value(tmp_path, flag, value, attached):
    extra = tmp_path / "extra.toml"
    extra.write_text("max_steps = 7\n")
    file_args = [f"@{extra}"] if attached else ["@", str(extra)]
    config = parse_args(RLConfig, [*flag, *file_args], environ={})
    key = flag[0].removeprefix("--").removeprefix("no-").split("=")[0]
    assert config.max_steps == 7
    assert (config.resume if key == "resume" else config.preflight.enabled) is value


# ---- every phase stops cleanly ----


def test_a_signal_waits_for_the_end_of_a_held_block_and_an_error_on_its_way_out_wins():
    before = signal.getsignal(signal.SIGTERM)

    @stops_cleanly("test")
    def held_then(fail: bool) -> int:
        with held_signals():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # the handler has run: the signal is held
            if fail:
                raise ValueError("the block's own error")
        return 0  # never reached: raised at the block's end

    assert held_then(False) == 1
    with pytest.raises(ValueError, match="the block's own error"):
        held_then(True)
    assert signal.getsignal(signal.SIGTERM) == before  # the handler is given back


def start(argv: list[str], stderr: Path) -> subprocess.Popen:
    """`argv` running, its stderr in the file `stderr` (read while it runs), stdout discarded."""
    return subprocess.Popen(argv, cwd=REPO, env=env(), stdout=subprocess.DEVNULL, stderr=stderr.open("w"), text=True)


def wait_until(started: Callable[[], bool], proc: subprocess.Popen, what: str, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while not started():
        assert proc.poll() is None, f"it ended (exit code {proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"not {what} within {timeout_s} s"
        time.sleep(0.1)


def log_says(path: Path, text: str) -> Callable[[], bool]:
    return lambda: path.is_file() and text in path.read_text()


def processes_naming(marker: str) -> list[str]:
    """Command lines of the live processes (this one aside) that name `marker`: a run's leftovers."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # ended meanwhile
            continue
        if marker in argv:
            found.append(argv)
    return found


def each_signal_stops_it(tmp_path: Path, command: str, argv: Callable[[Path], list[str]],
                         started: Callable[[Path], Callable[[], bool]], what: str) -> dict[signal.Signals, Path]:
    """Run `argv(root)` once per signal (at the same time, in its own `root`), send the signal once `started(root)`
    says so: each must end with exit code 1 and the one line `tandem <command>: stopped by SIG...` (no traceback),
    leaving no process that names its `root`. Returns the roots."""
    runs: dict[signal.Signals, tuple[Path, subprocess.Popen]] = {}
    try:
        for sig in SIGNALS:
            root = tmp_path / sig.name
            root.mkdir()
            runs[sig] = root, start(argv(root), root / "stderr")
        for sig, (root, proc) in runs.items():
            wait_until(started(root), proc, what)
            proc.send_signal(sig)
            code = proc.wait(timeout=60)
            text = (root / "stderr").read_text()
            assert code == 1 and "Traceback" not in text, (sig.name, code, text[-3000:])
            assert text.rstrip().splitlines()[-1] == f"tandem {command}: stopped by {sig.name}", text[-3000:]
            assert not processes_naming(str(root)), sig.name
    finally:
        for _, proc in runs.values():
            if proc.poll() is None:
                proc.kill()  # a launcher's children follow it (they get SIGTERM when it dies)
    return {sig: root for sig, (root, _) in runs.items()}


def tiny_task(root: Path, model: Path) -> None:
    """The base model and data of `sft_toml(root, ...)`, made beforehand."""
    (root / "data").mkdir()
    (root / "data" / "train.jsonl").write_text("".join(json.dumps({"prompt": w, "completion": w[::-1]}) + "\n"
                                                      for w in ("abc", "hello", "tandem", "stop")))
    (root / "base").symlink_to(model)


@pytest.mark.slow
def test_the_warm_up_stops_cleanly(model, tmp_path):
    def argv(root: Path) -> list[str]:
        tiny_task(root, model)
        return cli("rl", "@", EXAMPLE_RL, "--model.name", str(root / "sft" / "weights" / "final"),
                   "--warmup.sft", str(sft_toml(root, 100_000)), "--output-dir", str(root / "rl"))

    roots = each_signal_stops_it(tmp_path, "rl", argv, lambda root: log_says(root / "rl" / "logs" / "sft.log", "step 1: loss"),
                                 "the warm-up's SFT stepped")
    for root in roots.values():  # the launcher stopped its SFT the same way
        assert (root / "rl" / "logs" / "sft.log").read_text().rstrip().endswith("tandem sft: stopped by SIGTERM")


@pytest.mark.slow
def test_tandem_sft_stops_cleanly(model, tmp_path):
    def argv(root: Path) -> list[str]:
        tiny_task(root, model)
        return cli("sft", "@", str(sft_toml(root, 100_000)))

    each_signal_stops_it(tmp_path, "sft", argv, lambda root: log_says(root / "stderr", "step 1: loss"), "SFT stepped")


@pytest.mark.slow
def test_tandem_eval_stops_cleanly(model, tmp_path):
    """Stopped while its rollouts wait on its server: a fake one per run, holding each request for a minute."""
    from orchestrator.fake_inference_server import FakeBackend, ServerThread, make_app
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    servers: dict[Path, tuple[FakeBackend, ServerThread]] = {}

    def argv(root: Path) -> list[str]:
        backend = FakeBackend(tokenizer, delay_s=60)
        servers[root] = backend, ServerThread(make_app(backend)).__enter__()
        return cli("eval", "--model.name", str(model), "--output-dir", str(root / "run"),
                   "--client.base-urls", f'["{servers[root][1].url}"]', "--eval.num-examples", "2",
                   "--envs", '[{id = "reverse_text", args = {num_train_examples = 4, num_eval_examples = 2}}]')

    try:
        each_signal_stops_it(tmp_path, "eval", argv, lambda root: lambda: bool(servers[root][0].requests),
                             "the eval's first rollout request")
    finally:
        for _, server in servers.values():
            server.server.force_exit = True  # its requests would wait out their minute
            server.__exit__()


@pytest.mark.slow
def test_the_preflight_stops_cleanly(model, tmp_path):
    each_signal_stops_it(tmp_path, "rl", lambda root: rl_command(model, root / "run", 50, "--preflight.enabled", "true"),
                         lambda root: lambda: any((root / "run" / "logs").glob("*preflight*.log")), "the preflight started")


@pytest.mark.slow
def test_the_rl_run_stops_cleanly(model, tmp_path):
    each_signal_stops_it(tmp_path, "rl", lambda root: rl_command(model, root / "run", 50),
                         lambda root: log_says(root / "run" / "logs" / "trainer.log", "starting after step 0"),
                         "the trainer started")
