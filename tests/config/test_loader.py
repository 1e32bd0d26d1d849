"""Config composition: files, environment, flags, shared fields, and every bad-input message."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.config.base import ProcessConfig, Section
from tandem.config.loader import ConfigError, parse_args
from tandem.config.orchestrator import OrchestratorConfig


class Optim(Section):
    lr: float = 1e-3
    """Learning rate."""
    betas: list[float] = [0.9, 0.99]
    """Adam betas."""


class Ckpt(Section):
    enabled: bool = True
    """Write checkpoints."""
    interval: int = 10
    """Steps between checkpoints."""


class Demo(ProcessConfig):
    optim: Optim = Optim()
    """Optimizer."""
    ckpt: Ckpt = Ckpt()
    """Checkpoints."""


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_later_files_then_env_then_flags_win(tmp_path):
    a = write(tmp_path, "a.toml", "seq_len = 100\nmax_steps = 5\n[optim]\nlr = 0.1\n")
    b = write(tmp_path, "b.toml", "max_steps = 7\n[optim]\nlr = 0.2\n")
    cfg = parse_args(Demo, ["@", a, "@", b], environ={})
    assert (cfg.seq_len, cfg.max_steps, cfg.optim.lr) == (100, 7, 0.2)
    cfg = parse_args(Demo, ["@", a, "@", b], environ={"TANDEM_OPTIM__LR": "0.3", "TANDEM_MAX_STEPS": "9"})
    assert (cfg.optim.lr, cfg.max_steps) == (0.3, 9)
    cfg = parse_args(Demo, ["@", a, "--optim.lr", "3e-6", "@", b], environ={"TANDEM_OPTIM__LR": "0.3"})
    assert cfg.optim.lr == 3e-6  # flags beat files given after them and the environment


def test_flag_forms(tmp_path):
    cfg = parse_args(Demo, ["--no-ckpt.enabled", "--ckpt.interval=3", "--optim.betas", "[0.8, 0.9]", "--run.name", "x"], environ={})
    assert cfg.ckpt.enabled is False and cfg.ckpt.interval == 3 and cfg.optim.betas == [0.8, 0.9]
    assert cfg.run_dir == Path("outputs/x")
    cfg = parse_args(Demo, ["--ckpt.enabled"], environ={})
    assert cfg.ckpt.enabled is True
    cfg = parse_args(Demo, ["--seq-len", "64", "--output-dir", "/tmp/o"], environ={})
    assert cfg.seq_len == 64 and cfg.run_dir == Path("/tmp/o")


def test_a_plain_value_for_a_list_key_is_comma_separated():
    from tandem.config.eval import EvalConfig

    cfg = parse_args(Demo, ["--optim.betas", "0.8,0.95"], environ={})
    assert cfg.optim.betas == [0.8, 0.95]
    cfg = parse_args(Demo, [], environ={"TANDEM_OPTIM__BETAS": "0.7, 0.9"})
    assert cfg.optim.betas == [0.7, 0.9]
    urls = parse_args(EvalConfig, ["--client.base-urls", "http://127.0.0.1:8011"], environ={}).client.base_urls
    assert urls == ["http://127.0.0.1:8011"]
    urls = parse_args(EvalConfig, ["--client.base-urls", "http://a:1,http://b:2"], environ={}).client.base_urls
    assert urls == ["http://a:1", "http://b:2"]
    with pytest.raises(ConfigError, match="optim.betas"):
        parse_args(Demo, ["--optim.betas", "0.8,fast"], environ={})


def test_section_from_file(tmp_path):
    opt = write(tmp_path, "opt.toml", "lr = 0.5\nbetas = [0.1, 0.2]\n")
    cfg = parse_args(Demo, ["--optim", "@", opt], environ={})
    assert cfg.optim.lr == 0.5 and cfg.optim.betas == [0.1, 0.2]


def test_unrelated_environment_is_ignored():
    cfg = parse_args(Demo, [], environ={"TANDEM_HOME": "/x", "PATH": "/bin"})
    assert cfg.seq_len == Demo().seq_len


def test_unknown_key_names_key_file_and_suggestion(tmp_path):
    bad = write(tmp_path, "bad.toml", "[optim]\nlrr = 0.1\n")
    with pytest.raises(ConfigError) as err:
        parse_args(Demo, ["@", bad], environ={})
    assert str(err.value) == f"unknown key `optim.lrr` (from {bad}); did you mean `optim.lr`?"
    with pytest.raises(ConfigError, match=r"unknown key `ckpt.intervall` \(from the command line\); did you mean `ckpt.interval`\?"):
        parse_args(Demo, ["--ckpt.intervall", "3"], environ={})
    with pytest.raises(ConfigError, match=r"unknown key `optim.beta` \(from environment variable TANDEM_OPTIM__BETA\)"):
        parse_args(Demo, [], environ={"TANDEM_OPTIM__BETA": "1"})


def test_wrong_type_names_key_value_and_type(tmp_path):
    bad = write(tmp_path, "bad.toml", "[ckpt]\ninterval = \"often\"\n")
    with pytest.raises(ConfigError) as err:
        parse_args(Demo, ["@", bad], environ={})
    msg = str(err.value)
    assert msg.startswith(f"invalid value for `ckpt.interval` (from {bad}): 'often'") and "valid integer" in msg
    with pytest.raises(ConfigError, match=r"invalid value for `optim.lr` \(from the command line\): 'fast'.*valid number"):
        parse_args(Demo, ["--optim.lr", "fast"], environ={})


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: /nonexistent/x.toml"):
        parse_args(Demo, ["@", "/nonexistent/x.toml"], environ={})
    broken = write(tmp_path, "broken.toml", "seq_len = = 3\n")
    with pytest.raises(ConfigError, match=f"{broken}: invalid TOML"):
        parse_args(Demo, ["@", broken], environ={})
    with pytest.raises(ConfigError, match="unexpected argument 'stray'"):
        parse_args(Demo, ["stray"], environ={})


def test_a_flag_without_a_value_is_only_for_boolean_keys():
    with pytest.raises(ConfigError, match=r"flag `--max-steps` \(from the command line\) has no value, but `max_steps` is "
                                          r"not a boolean key: write `--max-steps VALUE`"):
        parse_args(Demo, ["--max-steps"], environ={})
    with pytest.raises(ConfigError, match=r"flag `--no-optim.lr` .* `optim.lr` is not a boolean key"):
        parse_args(Demo, ["--no-optim.lr"], environ={})
    with pytest.raises(ConfigError, match=r"unknown key `ckpt.enable` \(from the command line\)"):
        parse_args(Demo, ["--ckpt.enable"], environ={})
    assert parse_args(Demo, ["--ckpt.enabled", "--max-steps", "3"], environ={}).max_steps == 3


def test_a_section_check_names_the_flag_that_broke_it_not_the_whole_section(tmp_path):
    f = write(tmp_path, "o.toml", "group_size = 4\nbatch_size = 8\n[sampling]\nmax_tokens = 9\n")
    with pytest.raises(ConfigError) as err:
        parse_args(OrchestratorConfig, ["@", f, "--batch_size", "-3"], environ={})
    assert str(err.value) == (f"`batch_size` = -3 must be a positive multiple of `group_size` = 4 "
                              f"(`batch_size` from the command line; `group_size` from {f})")


def test_a_text_key_keeps_a_flag_or_variables_text_as_given():
    """A value of digits (or `true`) for a key that only takes text is that text, not the number TOML reads."""
    from tandem.config.inference import InferenceConfig

    cfg = parse_args(InferenceConfig, ["--server.api-key", "0123", "--run.name=true", "--server.port", "8001"], environ={})
    assert (cfg.server.api_key, cfg.run.name, cfg.server.port) == ("0123", "true", 8001)
    cfg = parse_args(InferenceConfig, [], environ={"TANDEM_SERVER__API_KEY": "42", "TANDEM_SERVER__PORT": "9000"})
    assert (cfg.server.api_key, cfg.server.port) == ("42", 9000)
    urls = parse_args(OrchestratorConfig, ["--client.base-urls", '["http://a:1", "http://b:2"]'], environ={}).client.base_urls
    assert urls == ["http://a:1", "http://b:2"]  # a list key still reads a TOML list
