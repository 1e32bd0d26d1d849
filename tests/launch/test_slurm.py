"""`tandem rl --slurm`: the rendered sbatch script, checked by bash and shellcheck, submitted to a fake `sbatch`
and run against fake `scontrol`/`srun` that record what each node would run; each node's command line is then
resolved as that node's launcher would resolve it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.config.resolve import parse_rl_args, process_configs

REPO = Path(__file__).resolve().parents[2]
SHELLCHECK = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))

# Fake Slurm tools. `srun` runs its command once per task with that task's SLURM_NODEID, but with the Python
# of the command replaced by `record`, which writes the node's argv to $RECORDS/node_<id>.json.
FAKES = {
    "sbatch": 'cp "$1" "$RECORDS/submitted.sbatch"; echo "Submitted batch job 42"\n',
    "scontrol": 'test "$1 $2 $3" = "show hostnames $SLURM_JOB_NODELIST" && printf "%s\\n" $FAKE_HOSTS\n',
    "srun": f'printf "%s\\n" "$@" > "$RECORDS/srun.args"\n{sys.executable} -c "$RUN_TASKS" "$@"\n',
    "record": f'{sys.executable} -c \'import json, os, sys; json.dump(sys.argv[1:], open(os.environ["RECORDS"] + "/node_" + os.environ["SLURM_NODEID"] + ".json", "w"))\' "$@"\n',
}
RUN_TASKS = """
import os, subprocess, sys
args = sys.argv[1:]
ntasks = int(next(a for a in args if a.startswith("--ntasks=")).split("=")[1])
command = args[args.index("bash"):]
python = command.index("-m") - 1
command[python] = "record"
for node in range(ntasks):
    subprocess.run(command, env={**os.environ, "SLURM_NODEID": str(node)}, check=True)
"""


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch) -> Path:
    bin_dir, records = tmp_path / "bin", tmp_path / "records"
    bin_dir.mkdir(), records.mkdir()
    for name, body in FAKES.items():
        (bin_dir / name).write_text(f"#!/bin/bash\nset -eu\n{body}")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("RECORDS", str(records))
    return records


def tandem_rl(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")} | {"PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "tandem.cli", "rl", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def cluster_args(num_nodes: int) -> list[str]:
    trainer_nodes = max(1, num_nodes - 1)
    return ["--deployment.cluster.num-nodes", str(num_nodes), "--deployment.cluster.num-trainer-nodes", str(trainer_nodes),
            "--deployment.type", "gpu", "--deployment.trainer-devices", "[0, 1, 2, 3]", "--deployment.inference-devices", "[0]",
            "--deployment.slurm.partition", "gpu", "--deployment.slurm.time-limit", "01:30:00", "--inference.server.port", "8100",
            "--run.name", "big run"]


def node_configs(script: Path, hosts: list[str], cwd: Path, records: Path) -> list:
    """Run the batch script on the fake allocation `hosts`; each node's config, resolved from the command line it got."""
    env = os.environ | {"SLURM_JOB_NODELIST": "gpu-[000-xxx]", "SLURM_JOB_ID": "77", "FAKE_HOSTS": " ".join(hosts),
                        "RUN_TASKS": RUN_TASKS}
    subprocess.run(["bash", str(script)], cwd=cwd, env=env, check=True)
    configs = []
    for node in range(len(hosts)):
        argv = json.loads((records / f"node_{node}.json").read_text())
        assert argv[:3] == ["-m", "tandem.cli", "rl"]
        configs.append(parse_rl_args(argv[3:], environ={}, machine=FourGPUs()))
    return configs


@pytest.mark.parametrize("num_nodes", [1, 2, 8])
def test_the_script_is_valid_shell_and_every_node_resolves_its_part(num_nodes, tmp_path, fake_slurm):
    result = tandem_rl(*cluster_args(num_nodes), "--slurm", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Submitted batch job 42" in result.stdout
    script = tmp_path / "outputs" / "big run" / "slurm" / "job.sbatch"
    assert (fake_slurm / "submitted.sbatch").read_text() == script.read_text()
    text = script.read_text()
    for directive in (f"--nodes={num_nodes}", "--time=01:30:00", "--partition=gpu", "--gpus-per-node=4", "--ntasks-per-node=1"):
        assert f"#SBATCH {directive}\n" in text
    subprocess.run(["bash", "-n", str(script)], check=True)
    if SHELLCHECK:
        checked = subprocess.run([SHELLCHECK, str(script)], capture_output=True, text=True)
        assert checked.returncode == 0, checked.stdout

    hosts = [f"gpu-{i:03d}" for i in range(num_nodes)]
    configs = node_configs(script, hosts, tmp_path, fake_slurm)
    srun = (fake_slurm / "srun.args").read_text().split("\n")
    assert {f"--nodes={num_nodes}", f"--ntasks={num_nodes}", "--kill-on-bad-exit=1"} <= set(srun)
    for node, config in enumerate(configs):
        cluster = config.deployment.cluster
        assert (cluster.node_rank, cluster.hosts, cluster.rendezvous_id, config.deployment.launcher) == (node, hosts, "slurm-77", "local")
        server = hosts[-1] if num_nodes > 1 else "127.0.0.1"  # one node: the orchestrator's own server
        assert config.orchestrator.client.base_urls == [f"http://{server}:8100"]
        assert config.orchestrator.num_trainer_ranks == 4 * max(1, num_nodes - 1)
    roles = [c.deployment.cluster.roles(i) for i, c in enumerate(configs)]
    assert sum(r.count("trainer") for r in roles) == max(1, num_nodes - 1) and roles[-1][:2] == ["inference", "orchestrator"]


def test_dry_run_prints_configs_and_script_and_submits_nothing(tmp_path, fake_slurm):
    result = tandem_rl(*cluster_args(2), "--slurm", "--dry-run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "# ---- orchestrator ----" in result.stdout and "# ---- slurm ----\n#!/bin/bash\n" in result.stdout
    assert not (fake_slurm / "submitted.sbatch").exists() and not (tmp_path / "outputs").exists()


def test_without_sbatch_the_script_is_written_and_the_command_shown(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))
    result = tandem_rl(*cluster_args(2), "--slurm", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"submit it from a Slurm login node with `sbatch {Path('outputs/big run/slurm/job.sbatch')}`" in result.stdout


class FourGPUs:
    def num_cuda_devices(self) -> int:
        return 4

    def free_port(self) -> int:
        raise AssertionError("a multi-node run never picks a free port")


def test_each_node_of_a_disaggregated_job_starts_its_pool_with_the_allocations_hosts(tmp_path, fake_slurm):
    pools = ("--deployment.cluster.num-inference-nodes", "2", "--deployment.cluster.num-prefill-nodes", "1",
             "--deployment.num-prefill-servers", "1", "--deployment.num-decode-servers", "1",
             "--inference.disaggregation.kv-transport", "torch_distributed")
    result = tandem_rl(*cluster_args(3), *pools, "--slurm", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    hosts = ["gpu-000", "gpu-001", "gpu-002"]
    configs = node_configs(tmp_path / "outputs" / "big run" / "slurm" / "job.sbatch", hosts, tmp_path, fake_slurm)
    servers = [{name: c.disaggregation for name, c in process_configs(config).items() if name not in ("orchestrator", "trainer")}
               for config in configs]
    assert [c.deployment.cluster.roles(i) for i, c in enumerate(configs)] == [["trainer"], ["inference", "trainer"],
                                                                              ["inference", "orchestrator"]]
    assert servers[0] == {} and servers[1]["prefill"].role == "prefill"
    decode = servers[2]["inference"]
    assert (decode.role, decode.prefill_urls, decode.forward_updates_to) == ("decode", ["http://gpu-001:8100"], ["http://gpu-001:8100"])
    assert all(c.orchestrator.client.base_urls == ["http://gpu-002:8100"] for c in configs)
