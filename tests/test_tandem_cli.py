"""The `tandem` command itself: help, dry-run output, errors without tracebacks."""

from __future__ import annotations

import subprocess
import sys
import tomllib

from tandem.cli import COMMANDS, Command, main


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tandem.cli", *args], capture_output=True, text=True, timeout=120)


def test_help_lists_every_subcommand(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in [*COMMANDS, "model"]:
        assert f"  {name} " in out


def test_dry_run_prints_each_process_config_as_toml(capsys):
    assert main(["rl", "--dry-run", "--seq-len", "96", "--model.name", "some/model"]) == 0
    out = capsys.readouterr().out
    sections = out.split("# ---- ")[1:]
    assert [s.split(" ----")[0] for s in sections] == ["inference", "orchestrator", "trainer"]
    for section in sections:
        parsed = tomllib.loads(section.split("\n", 1)[1])
        assert parsed["seq_len"] == 96 and parsed["model"]["name"] == "some/model"


def test_config_error_is_one_clear_line_and_exit_2():
    proc = run_cli("rl", "--seq_lenn", "3")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "unknown key `seq_lenn` (from the command line); did you mean `seq_len`?" in proc.stderr


def test_unknown_command():
    proc = run_cli("fly")
    assert proc.returncode == 2 and "unknown command 'fly'" in proc.stderr


def test_command_help_lists_keys(capsys):
    assert main(["rl", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--seq_len = 2048" in out and "--inference.server.port = 8000" in out


def test_a_missing_dependency_is_named_not_reported_as_unbuilt(tmp_path, monkeypatch, capsys):
    (tmp_path / "entry_needing_a_package.py").write_text("import a_package_that_is_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(COMMANDS, "eval", Command("tandem.config.eval:EvalConfig", "entry_needing_a_package:main", "x"))
    assert main(["eval"]) == 2
    err = capsys.readouterr().err
    assert "'a_package_that_is_not_installed'" in err and "not built" not in err


def test_dry_run_shows_the_derived_values_the_processes_get(capsys):
    assert main(["rl", "--dry-run", "--deployment.num-trainer-processes", "2", "--resume"]) == 0
    sections = {s.split(" ----")[0]: s.split("\n", 1)[1] for s in capsys.readouterr().out.split("# ---- ")[1:]}
    assert "# runs on: 2 rank(s) on the CPU" in sections["trainer"]
    orchestrator, trainer = tomllib.loads(sections["orchestrator"]), tomllib.loads(sections["trainer"])
    assert orchestrator["num_trainer_ranks"] == 2 and orchestrator["ckpt"]["resume"] and trainer["ckpt"]["resume"]
    assert trainer["device"] == "cpu"


def test_dry_run_says_which_nodes_run_each_process(capsys):
    assert main(["rl", "--dry-run", "--deployment.cluster.num-nodes", "3", "--deployment.cluster.hosts", '["a", "b", "c"]',
                 "--deployment.cluster.num-trainer-nodes", "2", "--deployment.num-trainer-processes", "2"]) == 0
    out = capsys.readouterr().out
    assert "# ---- trainer ----\n# runs on: 4 rank(s) on the CPU of node(s) 0 (a), 1 (b)\n" in out
    assert "# ---- orchestrator ----\n# runs on: the CPU of node(s) 2 (c)\n" in out


def test_dry_run_fails_on_a_combination_the_trainer_would_refuse():
    proc = run_cli("rl", "--dry-run", "--seq-len", "3", "--trainer.data.fake", "true", "--trainer.data.fake_samples_per_row", "2")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "in `trainer`: `data.fake_samples_per_row` = 2 leaves fewer than 2 tokens per sample at `seq_len` = 3" in proc.stderr


def test_a_flag_missing_its_value_is_an_error_not_true():
    proc = run_cli("rl", "--max-steps", "--dry-run")
    assert proc.returncode == 2 and "flag `--max-steps` (from the command line) has no value" in proc.stderr
