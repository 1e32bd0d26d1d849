"""Secrets (`tandem.config.secret`): never in a written config, `--dry-run`, a log or the W&B run; the processes
still get them (through their environment), and one started by hand takes them from a flag or a variable."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import tomli_w
from short_runs import API_KEY, REPO, env

from tandem.config.inference import InferenceConfig
from tandem.config.loader import ConfigError, parse_args, secret_env
from tandem.config.orchestrator import OrchestratorConfig
from tandem.config.resolve import parse_rl_args
from tandem.config.secret import REDACTED, secrets_of
from tandem.config.trainer import TrainerConfig
from tandem.launch.rl import _process_env

CONFIGS = {"inference": InferenceConfig, "orchestrator": OrchestratorConfig, "trainer": TrainerConfig}
SECRET_KEYS = {"inference": "server.api_key", "orchestrator": "client.api_key"}


def tandem(*args: str, cwd: Path = REPO, **variables: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tandem.cli", *args], cwd=cwd, env={**env(), "PYTHONPATH": str(REPO), **variables},
                          capture_output=True, text=True, timeout=120)


def test_dry_run_redacts_the_keys(tmp_path):
    printed = tandem("rl", "--output-dir", str(tmp_path), "--inference.server.api-key", API_KEY, "--dry-run")
    assert printed.returncode == 0, printed.stderr
    assert API_KEY not in printed.stdout + printed.stderr
    sections = printed.stdout.split("# ---- ")
    inference = tomllib.loads(next(s for s in sections if s.startswith("inference ----")).split("\n", 2)[2])
    orchestrator = tomllib.loads(next(s for s in sections if s.startswith("orchestrator ----")).split("\n", 2)[2])
    assert inference["server"]["api_key"] == REDACTED and orchestrator["client"]["api_key"] == REDACTED
    # The same from the environment, and for one process.
    printed = tandem("inference", "--dry-run", TANDEM_SERVER__API_KEY=API_KEY)
    assert printed.returncode == 0 and API_KEY not in printed.stdout and f'api_key = "{REDACTED}"' in printed.stdout


def test_a_written_config_needs_the_key_from_a_flag_or_the_environment(tmp_path):
    written = tmp_path / "inference.toml"
    written.write_text(f'[server]\napi_key = "{REDACTED}"\n')
    refused = tandem("inference", "@", str(written), "--dry-run")
    assert refused.returncode == 2
    assert f"invalid value for `server.api_key` (from {written})" in refused.stderr
    assert "TANDEM_SECTION__KEY" in refused.stderr and "--section.key VALUE" in refused.stderr
    by_flag = parse_args(InferenceConfig, ["@", str(written), "--server.api-key", API_KEY], environ={})
    by_variable = parse_args(InferenceConfig, ["@", str(written)], environ={"TANDEM_SERVER__API_KEY": API_KEY})
    assert by_flag.server.api_key == by_variable.server.api_key == API_KEY
    with pytest.raises(ConfigError, match="server.api_key"):
        parse_args(InferenceConfig, ["--server.api-key", REDACTED], environ={})


def test_config_errors_do_not_show_a_secret(tmp_path):
    (tmp_path / "server.toml").write_text("[server]\napi_key = 20240917\n")  # a TOML integer: the wrong type
    with pytest.raises(ConfigError) as refused:
        parse_args(InferenceConfig, ["@", str(tmp_path / "server.toml")], environ={})
    assert "20240917" not in str(refused.value) and f"`server.api_key` (from {tmp_path / 'server.toml'}): '{REDACTED}'" in str(refused.value)
    with pytest.raises(ConfigError) as refused:
        parse_rl_args(["--output-dir", str(tmp_path), "--inference.server.api-key", API_KEY,
                       "--orchestrator.client.api-key", "another-key"], environ={})
    assert f"`orchestrator.client.api_key` = '{REDACTED}' (from the command line) contradicts" in str(refused.value)
    assert API_KEY not in str(refused.value) and "another-key" not in str(refused.value)


@pytest.mark.parametrize("key", [API_KEY, "123", "true", 'a "quoted" \\ key', "clé ü"])
def test_each_process_gets_its_secrets_exactly_through_its_environment(tmp_path, key):
    (tmp_path / "rl.toml").write_text(tomli_w.dumps({"inference": {"server": {"api_key": key}}}))
    config = parse_rl_args(["@", str(tmp_path / "rl.toml"), "--output-dir", str(tmp_path)], environ={})
    server_env, orchestrator_env = _process_env(config, "inference", None), _process_env(config, "orchestrator", None)
    assert secret_env(config.inference) == {"TANDEM_SERVER__API_KEY": server_env["TANDEM_SERVER__API_KEY"]}
    assert parse_args(InferenceConfig, [], environ=server_env).server.api_key == key
    assert "TANDEM_CLIENT__API_KEY" in orchestrator_env and "TANDEM_SERVER__API_KEY" not in orchestrator_env
    assert _process_env(config, "orchestrator-preflight", None)["TANDEM_CLIENT__API_KEY"] == orchestrator_env["TANDEM_CLIENT__API_KEY"]
    assert not any(name.startswith("TANDEM_") for name in _process_env(config, "trainer", None))


def test_k8s_manifests_hold_the_key_in_a_secret_that_only_their_owner_reads(tmp_path):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    argv = ["rl", "--deployment.cluster.num-nodes", "2", "--k8s"]
    printed = tandem(*argv, "--dry-run", cwd=tmp_path, TANDEM_INFERENCE__SERVER__API_KEY=API_KEY)
    assert printed.returncode == 0 and API_KEY not in printed.stdout + printed.stderr, printed.stderr
    written = tandem(*argv, cwd=tmp_path, TANDEM_INFERENCE__SERVER__API_KEY=API_KEY)
    assert written.returncode == 0 and API_KEY not in written.stdout + written.stderr, written.stderr
    path = tmp_path / "outputs" / "default" / "k8s" / "manifests.yaml"
    assert path.stat().st_mode & 0o777 == 0o600
    objects = {f"{o['kind']}/{o['metadata']['name']}": o for o in map(json.loads, path.read_text().split("---\n")[1:])}
    for obj in objects.values():
        kubernetes_validate.validate(obj, "1.37.0", strict=True)
    values = objects["Secret/default-secrets"]["stringData"]
    shown = printed.stdout.split("# ---- k8s ----\n")[1]
    assert shown == path.read_text().replace(json.dumps(values, indent=2).replace("\n", "\n  "),
                                             json.dumps(dict.fromkeys(values, REDACTED), indent=2).replace("\n", "\n  "))
    configs = objects["ConfigMap/default-config"]["data"]
    for role, workload in (("inference", "StatefulSet"), ("orchestrator", "Job"), ("trainer", "Job")):
        container = objects[f"{workload}/default-{role}"]["spec"]["template"]["spec"]["containers"][0]
        variables = {e["name"]: values[e["valueFrom"]["secretKeyRef"]["key"]] for e in container["env"] if "valueFrom" in e}
        (tmp_path / f"{role}.toml").write_text(configs[f"{role}.toml"])
        process_config = parse_args(CONFIGS[role], ["@", str(tmp_path / f"{role}.toml")], environ=variables)
        assert secrets_of(process_config) == ({} if role == "trainer" else {SECRET_KEYS[role]: API_KEY})
        assert REDACTED in configs[f"{role}.toml"] or role == "trainer"


def test_slurm_refuses_a_key_on_the_command_line(tmp_path):
    argv = ["rl", "--deployment.cluster.num-nodes", "2", "--slurm", "--dry-run"]
    refused = tandem(*argv, "--inference.server.api-key", API_KEY, cwd=tmp_path)
    assert refused.returncode == 2 and API_KEY not in refused.stdout + refused.stderr
    assert "`--inference.server.api-key` puts a secret on the command line" in refused.stderr
    assert "TANDEM_INFERENCE__SERVER__API_KEY" in refused.stderr
    refused = tandem(*argv, f"--orchestrator.client.api-key={API_KEY}", "--inference.server.api-key", API_KEY, cwd=tmp_path)
    assert refused.returncode == 2 and "`--orchestrator.client.api-key` puts a secret" in refused.stderr
    printed = tandem(*argv, cwd=tmp_path, TANDEM_INFERENCE__SERVER__API_KEY=API_KEY)  # sbatch passes it to the nodes
    assert printed.returncode == 0 and API_KEY not in printed.stdout + printed.stderr, printed.stderr


@pytest.mark.slow
def test_a_run_with_a_key_leaves_it_nowhere_in_its_folder(wandb_run):
    """A short real run and its resume, the key given on the command line both times, with W&B (offline; the
    `wandb_run` fixture of conftest.py): the server and the orchestrator got the key (the run trains), and no file
    of the run folder, logs and W&B's included, holds it."""
    out = wandb_run.out
    for result in (wandb_run.first, wandb_run.resumed):
        assert result.returncode == 0, result.stderr[-3000:]
        assert API_KEY not in result.stdout + result.stderr
    files = [path for path in out.rglob("*") if path.is_file()]
    assert any(path.parent.name == "logs" for path in files) and any("wandb" in path.parts for path in files)
    holding = [str(path.relative_to(out)) for path in files if API_KEY.encode() in path.read_bytes()]
    assert holding == []
    for name in ("inference", "orchestrator", "rl"):
        assert f'api_key = "{REDACTED}"' in (out / "configs" / f"{name}.toml").read_text()
